from pdproxy.cli import main

raise SystemExit(main())
