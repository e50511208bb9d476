// grafana-schema strictly decodes Grafana dashboards (Classic JSON model) with Grafana's foundation SDK,
// whose types are generated from Grafana's own dashboard and panel schemas.
//
//	grafana-schema DASHBOARD.json ...
//
// Strict: a field the schema does not know (in the dashboard, a panel, its fieldConfig or a panel
// plugin's options), a value of the wrong type or an enum value outside the schema is an error, and so
// is anything the SDK's Validate rejects. Prints one line per file; exits 1 when any file fails.
// Grafana itself cannot run in the tests (AGPL), so this is the check that a dashboard is one Grafana
// would load as written.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/variants"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/heatmap"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
	"github.com/grafana/grafana-foundation-sdk/go/stat"
	"github.com/grafana/grafana-foundation-sdk/go/table"
	"github.com/grafana/grafana-foundation-sdk/go/tempo"
	"github.com/grafana/grafana-foundation-sdk/go/text"
	"github.com/grafana/grafana-foundation-sdk/go/timeseries"
)

// The panel plugins and data sources whose schemas are checked: the ones pdproxy's dashboards use
// (registering only these, not the SDK's every plugin, keeps the cold build short). A panel of another
// type fails, unless it is one the SDK has no schema for (then only its panel-level fields are checked).
var noSchema = map[string]bool{"row": true, "alertlist": true}

func register() map[string]bool {
	runtime := cog.NewRuntime()
	checked := map[string]bool{}
	for _, v := range []variants.PanelcfgConfig{heatmap.VariantConfig(), stat.VariantConfig(), table.VariantConfig(),
		text.VariantConfig(), timeseries.VariantConfig()} {
		runtime.RegisterPanelcfgVariant(v)
		checked[v.Identifier] = true
	}
	runtime.RegisterDataqueryVariant(prometheus.VariantConfig())
	runtime.RegisterDataqueryVariant(tempo.VariantConfig())
	return checked
}

func check(path string, checked map[string]bool) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var d dashboard.Dashboard
	if err := real(d.UnmarshalJSONStrict(raw)); err != nil {
		return err
	}
	if err := real(d.Validate()); err != nil {
		return err
	}
	return panels(raw, checked)
}

// panels checks what the SDK's decoder leaves out: every panel's type has a schema here, and its
// fieldConfig is decoded strictly (the SDK reads it leniently, only its `custom` part strictly, by the
// panel plugin), so an unknown field in `defaults` fails too.
func panels(raw []byte, checked map[string]bool) error {
	var doc struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		return err
	}
	var errs cog.BuildErrors
	var walk func(path string, panels []json.RawMessage)
	walk = func(path string, panels []json.RawMessage) {
		for i, rawPanel := range panels {
			var p struct {
				Type        string            `json:"type"`
				FieldConfig json.RawMessage   `json:"fieldConfig"`
				Panels      []json.RawMessage `json:"panels"` // a collapsed row's
			}
			where := fmt.Sprintf("%s[%d]", path, i)
			if err := json.Unmarshal(rawPanel, &p); err != nil {
				errs = append(errs, cog.MakeBuildErrors(where, err)...)
				continue
			}
			if !checked[p.Type] && !noSchema[p.Type] {
				errs = append(errs, &cog.BuildError{Path: where + ".type",
					Message: fmt.Sprintf("panel type %q is not checked by tools/grafana-schema: register its schema", p.Type)})
			}
			if p.FieldConfig != nil {
				var fc dashboard.FieldConfigSource
				if err := real(fc.UnmarshalJSONStrict(p.FieldConfig)); err != nil {
					errs = append(errs, cog.MakeBuildErrors(where+".fieldConfig", err)...)
				}
			}
			walk(where+".panels", p.Panels)
		}
	}
	walk("panels", doc.Panels)
	if len(errs) == 0 {
		return nil
	}
	return errs
}

// real drops the empty error list some of the SDK's generated decoders return for "no error" (a nil
// cog.BuildErrors wrapped in a non-nil error interface).
func real(err error) error {
	var list cog.BuildErrors
	if errors.As(err, &list) && len(list) == 0 {
		return nil
	}
	return err
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: grafana-schema DASHBOARD.json ...")
		os.Exit(2)
	}
	checked := register()
	failed := false
	for _, path := range os.Args[1:] {
		if err := check(path, checked); err != nil {
			fmt.Printf("%s: %v\n", path, err)
			failed = true
			continue
		}
		fmt.Printf("%s: ok\n", path)
	}
	if failed {
		os.Exit(1)
	}
}
