// upgrade-libs runs the driver-upgrade state machine of github.com/NVIDIA/k8s-operator-libs
// (the version gpu-operator v26.7.0 vendors, pinned in go.mod) the way gpu-operator's
// upgrade controller runs it, against a test control plane: nothing of the libs is
// replaced. What gpu-operator adds around the libs is written here from its code and the
// fact sheets, as small as it is there:
//
//   - upgrade.SetDriverName("gpu") (the node keys nvidia.com/gpu-driver-upgrade-*);
//   - the state manager with StateOptions{} (requestor mode off),
//     WithPodDeletionEnabled(gpuPodSpecFilter) (pods requesting nvidia.com/gpu* or
//     nvidia.com/mig-* in spec.containers, Running or Pending),
//     WithValidationEnabled("app=nvidia-operator-validator") and, as gpu-operator >= v26.7.0
//     does, WithRestartOnlyPredicate(restartOnly): the running driver pod's and the driver
//     DaemonSet template's DRIVER_CONFIG_DIGEST env equal (and set) -> restart-only;
//   - its reconciler (v26.7.0 Reconcile): one request; the active ClusterPolicy (the oldest
//     not being deleted) with sandboxWorkloads on: the state label removed from every node.
//     ClusterPolicy mode (a ClusterPolicy without spec.driver.useNvidiaDriverCRD): its
//     spec.driver.upgradePolicy (autoUpgrade off: the state label removed from every node),
//     the driver pods and DaemonSets by app=nvidia-driver-daemonset in the operator namespace.
//     NVIDIADriver mode (useNvidiaDriverCRD: true, or no ClusterPolicy at all: a GPUCluster
//     cluster; reconcileNVIDIADriverUpgrades): one cluster state of the driver pods labelled
//     app.kubernetes.io/component=nvidia-driver, partitioned by each node's
//     nvidia.com/gpu-operator.driver.owner label (a node without it is skipped), and one
//     ApplyState per NVIDIADriver with its spec.upgradePolicy and gpu-operator's defaults
//     (GetUpgradePolicyWithDefaults: autoUpgrade true, maxParallelUpgrades 1, maxUnavailable
//     25%, even with no upgradePolicy); an NVIDIADriver with autoUpgrade false has the state
//     label removed from its nodes, and with none on, every node's is. In both modes the
//     drain selector gets "nvidia.com/gpu-driver-upgrade-drain.skip!=true" appended, and a
//     requeue every 2 minutes (--requeue); triggered by ClusterPolicy and NVIDIADriver
//     generation changes, node label changes and driver DaemonSet generation changes.
//
// Not played: OpenShift's driver-toolkit labels, and the DRA part of gpu-operator's pod
// deletion filter (pods holding gpu.nvidia.com claims): the test worlds have no
// ResourceClaims.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/NVIDIA/k8s-operator-libs/api/upgrade/v1alpha1"
	"github.com/NVIDIA/k8s-operator-libs/pkg/upgrade"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

const (
	// gpu-operator's controllers/upgrade_controller.go
	driverLabelKey   = "app"
	driverLabelValue = "nvidia-driver-daemonset"
	// NVIDIADriver mode: the driver pods and DaemonSets of every NVIDIADriver, and the
	// node label that names the NVIDIADriver owning a node.
	nvidiaDriverLabelKey   = "app.kubernetes.io/component"
	nvidiaDriverLabelValue = "nvidia-driver"
	driverOwnerLabel       = "nvidia.com/gpu-operator.driver.owner"
	skipDrainLabelSelector = "nvidia.com/gpu-driver-upgrade-drain.skip!=true"
	validatorSelector      = "app=nvidia-operator-validator"
	// The env gpu-operator sets on the driver container and the driver-manager init
	// container: a hash of what the driver install depends on.
	driverConfigDigestEnv = "DRIVER_CONFIG_DIGEST"
)

var (
	clusterPolicyGVK = schema.GroupVersionKind{Group: "nvidia.com", Version: "v1", Kind: "ClusterPolicy"}
	nvidiaDriverGVK  = schema.GroupVersionKind{Group: "nvidia.com", Version: "v1alpha1", Kind: "NVIDIADriver"}
)

// configDigest is the DRIVER_CONFIG_DIGEST literal of the first container, then init
// container, that sets it; "" when none does.
func configDigest(spec *corev1.PodSpec) string {
	for _, containers := range [][]corev1.Container{spec.Containers, spec.InitContainers} {
		for i := range containers {
			for _, env := range containers[i].Env {
				if env.Name == driverConfigDigestEnv && env.ValueFrom == nil {
					return env.Value
				}
			}
		}
	}
	return ""
}

// restartOnly is gpu-operator's restart-only rule (its PR #2527, written from the fact):
// the running driver pod and the DaemonSet template carry the same, non-empty digest. A
// missing or differing digest takes the full upgrade flow.
func restartOnly(running, desired *corev1.PodSpec) (bool, error) {
	digest := configDigest(running)
	return digest != "" && digest == configDigest(desired), nil
}

// gpuPodSpecFilter is gpu-operator's PodDeletionFilter (cmd/gpu-operator/main.go), without
// its DRA claim check (see the package comment).
func gpuPodSpecFilter(pod corev1.Pod) bool {
	gpuIn := func(rl corev1.ResourceList) bool {
		for name := range rl {
			if strings.HasPrefix(string(name), "nvidia.com/gpu") || strings.HasPrefix(string(name), "nvidia.com/mig-") {
				return true
			}
		}
		return false
	}
	if pod.Status.Phase != corev1.PodRunning && pod.Status.Phase != corev1.PodPending {
		return false
	}
	for _, c := range pod.Spec.Containers {
		if gpuIn(c.Resources.Limits) || gpuIn(c.Resources.Requests) {
			return true
		}
	}
	return false
}

type reconciler struct {
	client.Client
	manager   upgrade.ClusterUpgradeStateManager
	namespace string
	requeue   time.Duration
}

// decode reads an upgrade policy (a ClusterPolicy's spec.driver.upgradePolicy or an
// NVIDIADriver's spec.upgradePolicy) into the libs' type; nil when absent.
func decode(obj map[string]interface{}, path ...string) (*v1alpha1.DriverUpgradePolicySpec, error) {
	raw, found, err := unstructured.NestedMap(obj, path...)
	if err != nil || !found {
		return nil, err
	}
	text, err := json.Marshal(raw)
	if err != nil {
		return nil, err
	}
	policy := &v1alpha1.DriverUpgradePolicySpec{}
	if err := json.Unmarshal(text, policy); err != nil {
		return nil, fmt.Errorf("%s: %w", strings.Join(path, "."), err)
	}
	return policy, nil
}

// activeClusterPolicy is the oldest ClusterPolicy not being deleted (nil: none).
func (r *reconciler) activeClusterPolicy(ctx context.Context) (*unstructured.Unstructured, error) {
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(clusterPolicyGVK.GroupVersion().WithKind("ClusterPolicyList"))
	if err := r.List(ctx, list); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return nil, err
	}
	var alive []unstructured.Unstructured
	for _, cp := range list.Items {
		if cp.GetDeletionTimestamp() == nil {
			alive = append(alive, cp)
		}
	}
	if len(alive) == 0 {
		return nil, nil
	}
	sort.Slice(alive, func(i, j int) bool {
		a, b := alive[i].GetCreationTimestamp(), alive[j].GetCreationTimestamp()
		if !a.Equal(&b) {
			return a.Before(&b)
		}
		return alive[i].GetName() < alive[j].GetName()
	})
	return &alive[0], nil
}

// withDrainSkip appends gpu-operator's drain skip selector.
func withDrainSkip(policy *v1alpha1.DriverUpgradePolicySpec) {
	if policy.DrainSpec == nil {
		policy.DrainSpec = &v1alpha1.DrainSpec{}
	}
	if policy.DrainSpec.PodSelector == "" {
		policy.DrainSpec.PodSelector = skipDrainLabelSelector
	} else {
		policy.DrainSpec.PodSelector = policy.DrainSpec.PodSelector + "," + skipDrainLabelSelector
	}
}

func (r *reconciler) Reconcile(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	cp, err := r.activeClusterPolicy(ctx)
	if err != nil {
		return reconcile.Result{}, err
	}
	if cp != nil {
		if sandbox, _, _ := unstructured.NestedBool(cp.Object, "spec", "sandboxWorkloads", "enabled"); sandbox {
			log.Info("sandbox workloads: removing the upgrade state label from every node")
			return reconcile.Result{}, r.removeStateLabels(ctx, nil)
		}
		if crd, _, _ := unstructured.NestedBool(cp.Object, "spec", "driver", "useNvidiaDriverCRD"); !crd {
			return r.reconcileClusterPolicy(ctx, cp)
		}
	}
	return r.reconcileNVIDIADrivers(ctx)
}

// reconcileClusterPolicy is ClusterPolicy mode: its upgrade policy for every node.
func (r *reconciler) reconcileClusterPolicy(ctx context.Context, cp *unstructured.Unstructured) (reconcile.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	policy, err := decode(cp.Object, "spec", "driver", "upgradePolicy")
	if err != nil {
		return reconcile.Result{}, err
	}
	if policy == nil || !policy.AutoUpgrade {
		log.Info("driver auto upgrade is off: removing the upgrade state label from every node")
		return reconcile.Result{}, r.removeStateLabels(ctx, nil)
	}
	state, err := r.manager.BuildState(ctx, r.namespace, map[string]string{driverLabelKey: driverLabelValue})
	if err != nil {
		log.Error(err, "Failed to build cluster upgrade state")
		return reconcile.Result{}, err
	}
	withDrainSkip(policy)
	if err := r.manager.ApplyState(ctx, state, policy); err != nil {
		log.Error(err, "Failed to apply cluster upgrade state")
		return reconcile.Result{}, err
	}
	return reconcile.Result{RequeueAfter: r.requeue}, nil
}

// nvidiaDriverPolicy is GetUpgradePolicyWithDefaults: autoUpgrade true unless set false,
// maxParallelUpgrades 1 and maxUnavailable 25% unless set.
func nvidiaDriverPolicy(obj map[string]interface{}) (*v1alpha1.DriverUpgradePolicySpec, error) {
	policy, err := decode(obj, "spec", "upgradePolicy")
	if err != nil {
		return nil, err
	}
	raw, _, _ := unstructured.NestedMap(obj, "spec", "upgradePolicy")
	if policy == nil {
		policy = &v1alpha1.DriverUpgradePolicySpec{}
	}
	if _, set := raw["autoUpgrade"]; !set {
		policy.AutoUpgrade = true
	}
	if _, set := raw["maxParallelUpgrades"]; !set {
		policy.MaxParallelUpgrades = 1
	}
	if policy.MaxUnavailable == nil {
		unavailable := intstr.FromString("25%")
		policy.MaxUnavailable = &unavailable
	}
	return policy, nil
}

// reconcileNVIDIADrivers is NVIDIADriver mode: one cluster state, partitioned by the
// owner label, each NVIDIADriver's policy applied to its own nodes.
func (r *reconciler) reconcileNVIDIADrivers(ctx context.Context) (reconcile.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(nvidiaDriverGVK.GroupVersion().WithKind("NVIDIADriverList"))
	if err := r.List(ctx, list); err != nil && !apierrors.IsNotFound(err) {
		return reconcile.Result{}, err
	}
	policies := map[string]*v1alpha1.DriverUpgradePolicySpec{}
	for _, nvd := range list.Items {
		policy, err := nvidiaDriverPolicy(nvd.Object)
		if err != nil {
			return reconcile.Result{}, err
		}
		if policy.AutoUpgrade {
			policies[nvd.GetName()] = policy
		} else {
			owner := nvd.GetName()
			log.Info("driver auto upgrade is off: removing the upgrade state label", "nvidiadriver", owner)
			if err := r.removeStateLabels(ctx, &owner); err != nil {
				return reconcile.Result{}, err
			}
		}
	}
	if len(policies) == 0 {
		log.Info("no NVIDIADriver with auto upgrade on: removing the upgrade state label from every node")
		return reconcile.Result{}, r.removeStateLabels(ctx, nil)
	}
	state, err := r.manager.BuildState(ctx, r.namespace, map[string]string{nvidiaDriverLabelKey: nvidiaDriverLabelValue})
	if err != nil {
		log.Error(err, "Failed to build cluster upgrade state")
		return reconcile.Result{}, err
	}
	parts := map[string]*upgrade.ClusterUpgradeState{}
	for name := range policies {
		part := upgrade.NewClusterUpgradeState()
		parts[name] = &part
	}
	for nodeState, nodes := range state.NodeStates {
		for _, ns := range nodes {
			owner, labelled := ns.Node.Labels[driverOwnerLabel]
			if !labelled {
				log.Info("node has no driver owner label: skipped", "node", ns.Node.Name)
				continue
			}
			if part, ok := parts[owner]; ok {
				part.NodeStates[nodeState] = append(part.NodeStates[nodeState], ns)
			}
		}
	}
	names := make([]string, 0, len(parts))
	for name := range parts {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		policy := policies[name]
		withDrainSkip(policy)
		if err := r.manager.ApplyState(ctx, parts[name], policy); err != nil {
			log.Error(err, "Failed to apply cluster upgrade state", "nvidiadriver", name)
			return reconcile.Result{}, err
		}
	}
	return reconcile.Result{RequeueAfter: r.requeue}, nil
}

// removeStateLabels removes the state label from every node, or (owner) from the nodes
// an NVIDIADriver owns.
func (r *reconciler) removeStateLabels(ctx context.Context, owner *string) error {
	nodes := &corev1.NodeList{}
	opts := []client.ListOption{}
	if owner != nil {
		opts = append(opts, client.MatchingLabels{driverOwnerLabel: *owner})
	}
	if err := r.List(ctx, nodes, opts...); err != nil {
		return err
	}
	key := upgrade.GetUpgradeStateLabelKey()
	for i := range nodes.Items {
		node := &nodes.Items[i]
		if _, present := node.Labels[key]; present {
			delete(node.Labels, key)
			if err := r.Update(ctx, node); err != nil {
				return err
			}
		}
	}
	return nil
}

func main() {
	namespace := flag.String("namespace", "gpu-operator", "the operator namespace (driver pods and DaemonSets)")
	requeue := flag.Duration("requeue", 2*time.Minute, "the planned requeue (gpu-operator's plannedRequeueInterval)")
	health := flag.String("health-probe-bind-address", "127.0.0.1:0", "serves /healthz and /readyz")
	opts := zap.Options{}
	opts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts)))
	setupLog := ctrl.Log.WithName("setup")

	cfg, err := ctrl.GetConfig()
	if err != nil {
		setupLog.Error(err, "no kubeconfig")
		os.Exit(1)
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: *health,
		LeaderElection:         false,
	})
	if err != nil {
		setupLog.Error(err, "unable to create the manager")
		os.Exit(1)
	}

	upgrade.SetDriverName("gpu")
	upgradeLog := ctrl.Log.WithName("controllers").WithName("Upgrade")
	manager, err := upgrade.NewClusterUpgradeStateManager(
		upgradeLog, mgr.GetConfig(), mgr.GetEventRecorderFor("nvidia-gpu-operator"), upgrade.StateOptions{})
	if err != nil {
		setupLog.Error(err, "unable to create the ClusterUpgradeStateManager")
		os.Exit(1)
	}
	manager = manager.WithPodDeletionEnabled(gpuPodSpecFilter).
		WithValidationEnabled(validatorSelector).
		WithRestartOnlyPredicate(restartOnly)

	r := &reconciler{Client: mgr.GetClient(), manager: manager, namespace: *namespace, requeue: *requeue}
	one := handler.EnqueueRequestsFromMapFunc(func(context.Context, client.Object) []reconcile.Request {
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Name: "driver-upgrade"}}}
	})
	cp := &unstructured.Unstructured{}
	cp.SetGroupVersionKind(clusterPolicyGVK)
	nvd := &unstructured.Unstructured{}
	nvd.SetGroupVersionKind(nvidiaDriverGVK)
	driverDaemonSet := predicate.NewPredicateFuncs(func(o client.Object) bool {
		labels := o.GetLabels()
		return o.GetNamespace() == *namespace &&
			(labels[driverLabelKey] == driverLabelValue || labels[nvidiaDriverLabelKey] == nvidiaDriverLabelValue)
	})
	err = ctrl.NewControllerManagedBy(mgr).
		Named("upgrade-controller").
		WithOptions(controller.Options{MaxConcurrentReconciles: 1}).
		Watches(cp, one, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Watches(nvd, one, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Watches(&corev1.Node{}, one, builder.WithPredicates(predicate.LabelChangedPredicate{})).
		Watches(&appsv1.DaemonSet{}, one,
			builder.WithPredicates(predicate.And(predicate.GenerationChangedPredicate{}, driverDaemonSet))).
		Complete(r)
	if err != nil {
		setupLog.Error(err, "unable to create the upgrade controller")
		os.Exit(1)
	}
	if err := mgr.AddHealthzCheck("health", healthz.Ping); err != nil {
		os.Exit(1)
	}
	if err := mgr.AddReadyzCheck("check", healthz.Ping); err != nil {
		os.Exit(1)
	}
	setupLog.Info("starting manager")
	if err := mgr.Start(ctrl.SetupSignalHandler()); err != nil {
		setupLog.Error(err, "problem running manager")
		os.Exit(1)
	}
}
