// Command helmrender renders a Helm chart directory the way `helm template` does,
// using Helm's own chart loader, values coalescing, template engine and manifest
// sorter (helm.sh/helm/v3), without a cluster, a repository or a download.
//
//	helmrender [--name NAME] [--namespace NS] [--kube-version V] [--api-versions GV[/KIND]]... [--kubeconfig FILE] [-f values.yaml]... [--set k=v]... CHART_DIR
//	helmrender --lint [--strict] [--namespace NS] [--kube-version V] [-f values.yaml]... [--set k=v]... CHART_DIR
//
// .Capabilities are helm template's offline defaults, with --kube-version and
// --api-versions as `helm template` takes them; or, with --kubeconfig, what `helm install`
// reads from the cluster (pkg/action's getCapabilities: the server's /version and every
// group/version and group/version/Kind its discovery serves), so a chart that decides by
// .Capabilities renders here what helm install renders on that cluster.
//
// Output: the rendered manifests in install order, each as
// "---\n# Source: <chart>/templates/<file>\n<yaml>\n" (helm template's format).
// NOTES.txt and partials are not printed; hooks are printed after the manifests.
// Errors (a missing chart, bad values, a schema violation, a template error) go to
// stderr with exit status 1; bad usage exits 2.
//
// --lint runs `helm lint` instead (helm's pkg/lint, the rules of the helm command): every
// message is printed as "[SEVERITY] path: message"; the exit status is 1 when one is an
// ERROR (with --strict, also a WARNING), as `helm lint [--strict]` exits.
package main

import (
	"flag"
	"fmt"
	"os"
	"path"
	"strings"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
	"helm.sh/helm/v3/pkg/strvals"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/tools/clientcmd"
)

type multi []string

func (m *multi) String() string     { return strings.Join(*m, ",") }
func (m *multi) Set(v string) error { *m = append(*m, v); return nil }

// mergeMaps is helm's pkg/cli/values mergeMaps: b's keys win, maps merge deeply.
func mergeMaps(a, b map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(a))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		if v, ok := v.(map[string]interface{}); ok {
			if bv, ok := out[k]; ok {
				if bv, ok := bv.(map[string]interface{}); ok {
					out[k] = mergeMaps(bv, v)
					continue
				}
			}
		}
		out[k] = v
	}
	return out
}

func run() error {
	name := flag.String("name", "release-name", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	kubeVersion := flag.String("kube-version", "", "Kubernetes version of .Capabilities (default: the client-go version built in)")
	lintMode := flag.Bool("lint", false, "run helm lint on the chart instead of rendering it")
	strict := flag.Bool("strict", false, "with --lint: fail on warnings too (helm lint --strict)")
	kubeconfig := flag.String("kubeconfig", "", "take .Capabilities from this cluster, as helm install does")
	var files, sets, apiVersions multi
	flag.Var(&apiVersions, "api-versions", "add an API version (group/version or group/version/Kind) to .Capabilities.APIVersions (repeatable), as helm template --api-versions")
	flag.Var(&files, "f", "values file (repeatable; later files win)")
	flag.Var(&sets, "set", "value key=val (repeatable; after the files, later wins)")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: helmrender [--lint [--strict]] [--name NAME] [--namespace NS] [--kube-version V] [--api-versions GV]... [--kubeconfig FILE] [-f values.yaml]... [--set k=v]... CHART_DIR")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	vals := map[string]interface{}{}
	for _, f := range files {
		current, err := chartutil.ReadValuesFile(f)
		if err != nil {
			return fmt.Errorf("values file %s: %w", f, err)
		}
		vals = mergeMaps(vals, current.AsMap())
	}
	for _, s := range sets {
		if err := strvals.ParseInto(s, vals); err != nil {
			return fmt.Errorf("--set %s: %w", s, err)
		}
	}
	if *lintMode {
		return runLint(flag.Arg(0), vals, *namespace, *kubeVersion, *strict)
	}
	chrt, err := loader.Load(flag.Arg(0))
	if err != nil {
		return fmt.Errorf("loading chart %s: %w", flag.Arg(0), err)
	}
	if err := chartutil.ProcessDependenciesWithMerge(chrt, vals); err != nil {
		return fmt.Errorf("dependencies: %w", err)
	}
	caps := chartutil.DefaultCapabilities.Copy()
	if *kubeconfig != "" {
		if caps, err = clusterCapabilities(*kubeconfig); err != nil {
			return err
		}
	}
	caps.APIVersions = append(caps.APIVersions, apiVersions...)
	if *kubeVersion != "" {
		kv, err := chartutil.ParseKubeVersion(*kubeVersion)
		if err != nil {
			return fmt.Errorf("--kube-version %s: %w", *kubeVersion, err)
		}
		caps.KubeVersion = *kv
	}
	if chrt.Metadata.KubeVersion != "" && !chartutil.IsCompatibleRange(chrt.Metadata.KubeVersion, caps.KubeVersion.String()) {
		return fmt.Errorf("chart requires kubeVersion %s, which is incompatible with Kubernetes %s", chrt.Metadata.KubeVersion, caps.KubeVersion.String())
	}
	options := chartutil.ReleaseOptions{Name: *name, Namespace: *namespace, Revision: 1, IsInstall: true}
	top, err := chartutil.ToRenderValues(chrt, vals, options, caps)
	if err != nil {
		return fmt.Errorf("values: %w", err)
	}
	rendered, err := engine.Render(chrt, top)
	if err != nil {
		return fmt.Errorf("rendering: %w", err)
	}
	for k := range rendered {
		if strings.HasSuffix(k, "NOTES.txt") || strings.HasPrefix(path.Base(k), "_") {
			delete(rendered, k)
		}
	}
	hooks, manifests, err := releaseutil.SortManifests(rendered, caps.APIVersions, releaseutil.InstallOrder)
	if err != nil {
		return fmt.Errorf("sorting manifests: %w", err)
	}
	var b strings.Builder
	for _, m := range manifests {
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", m.Name, m.Content)
	}
	for _, h := range hooks {
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", h.Path, h.Manifest)
	}
	_, err = os.Stdout.WriteString(b.String())
	return err
}

// clusterCapabilities is helm's pkg/action (*Configuration).getCapabilities with
// GetVersionSet (v3.22.0, action.go), for the cluster of a kubeconfig: the server's version,
// and every group/version it serves and every group/version/Kind of its resources. (Not
// imported: pkg/action brings some 50 more modules to this small build.)
func clusterCapabilities(kubeconfig string) (*chartutil.Capabilities, error) {
	config, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
	}
	dc, err := discovery.NewDiscoveryClientForConfig(config)
	if err != nil {
		return nil, fmt.Errorf("could not get Kubernetes discovery client: %w", err)
	}
	kubeVersion, err := dc.ServerVersion()
	if err != nil {
		return nil, fmt.Errorf("could not get server version from Kubernetes: %w", err)
	}
	groups, resources, err := dc.ServerGroupsAndResources()
	if err != nil && !discovery.IsGroupDiscoveryFailedError(err) {
		return nil, fmt.Errorf("could not get apiVersions from Kubernetes: %w", err)
	}
	versions := chartutil.DefaultVersionSet
	if len(groups) > 0 || len(resources) > 0 {
		seen := map[string]bool{}
		versions = nil
		add := func(id string) {
			if !seen[id] {
				seen[id] = true
				versions = append(versions, id)
			}
		}
		for _, g := range groups {
			for _, gv := range g.Versions {
				add(gv.GroupVersion)
			}
		}
		for _, r := range resources {
			for _, rl := range r.APIResources {
				add(path.Join(r.GroupVersion, rl.Kind))
			}
		}
	}
	return &chartutil.Capabilities{
		APIVersions: versions,
		KubeVersion: chartutil.KubeVersion{
			Version: kubeVersion.GitVersion,
			Major:   kubeVersion.Major,
			Minor:   kubeVersion.Minor,
		},
		HelmVersion: chartutil.DefaultCapabilities.HelmVersion,
	}, nil
}

// runLint is `helm lint CHART_DIR` (pkg/action.Lint on a directory): helm's own rules
// (Chart.yaml, values and their schema, every template rendered and parsed, deprecated
// APIs, selectors, names, dependencies), with the given values.
func runLint(chartDir string, vals map[string]interface{}, namespace, kubeVersion string, strict bool) error {
	var kv *chartutil.KubeVersion
	if kubeVersion != "" {
		parsed, err := chartutil.ParseKubeVersion(kubeVersion)
		if err != nil {
			return fmt.Errorf("--kube-version %s: %w", kubeVersion, err)
		}
		kv = parsed
	}
	linter := lint.AllWithKubeVersion(chartDir, vals, namespace, kv)
	tolerance := support.ErrorSev
	if strict {
		tolerance = support.WarningSev
	}
	failed := 0
	for _, m := range linter.Messages {
		fmt.Println(m.Error())
		if m.Severity >= tolerance {
			failed++
		}
	}
	if failed > 0 {
		return fmt.Errorf("lint: %d chart(s) linted, %d message(s) failed", 1, failed)
	}
	fmt.Println("1 chart(s) linted, 0 chart(s) failed")
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "helmrender:", err)
		os.Exit(1)
	}
}
