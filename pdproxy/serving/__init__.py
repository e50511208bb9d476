"""The client's side of an inference request, whichever server carried it.

`Exchange` is all the request flow (`pdproxy/pd.py`) reads of a client's request and how it answers:
the head, the body, a whole answer or a stream. Two servers provide it: `LeanServer`
(`serving/lean.py`), pdproxy's own HTTP/1.1 protocol for plain POSTs to the inference routes, and
aiohttp's, through `AioExchange` (`serving/aio.py`), for every other request; a connection goes
from the first to the second, whole, the moment it carries anything else.
"""

from pdproxy.serving.aio import AioExchange
from pdproxy.serving.exchange import Exchange
from pdproxy.serving.lean import LeanServer

__all__ = ["AioExchange", "Exchange", "LeanServer"]
