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
//   - its reconciler: one request, the ClusterPolicy's spec.driver.upgradePolicy (autoUpgrade
//     off, or sandboxWorkloads on: the state label removed from every node), the driver pods
//     and DaemonSets by app=nvidia-driver-daemonset in the operator namespace, the drain
//     selector with "nvidia.com/gpu-driver-upgrade-drain.skip!=true" appended, BuildState,
//     ApplyState, and a requeue every 2 minutes (--requeue); triggered by ClusterPolicy
//     generation changes, node label changes and driver DaemonSet generation changes.
//
// Not played: the NVIDIADriver CRD path and OpenShift's driver-toolkit labels, and the DRA
// part of gpu-operator's pod deletion filter (pods holding gpu.nvidia.com claims): the
// test worlds have no ResourceClaims.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
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
	driverLabelKey         = "app"
	driverLabelValue       = "nvidia-driver-daemonset"
	skipDrainLabelSelector = "nvidia.com/gpu-driver-upgrade-drain.skip!=true"
	validatorSelector      = "app=nvidia-operator-validator"
	// The env gpu-operator sets on the driver container and the driver-manager init
	// container: a hash of what the driver install depends on.
	driverConfigDigestEnv = "DRIVER_CONFIG_DIGEST"
)

var clusterPolicyGVK = schema.GroupVersionKind{Group: "nvidia.com", Version: "v1", Kind: "ClusterPolicy"}

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
	manager       upgrade.ClusterUpgradeStateManager
	namespace     string
	clusterPolicy string
	requeue       time.Duration
}

// policy is the ClusterPolicy's upgrade policy, and whether the flow is off for it
// (sandboxWorkloads on); nil when there is no ClusterPolicy.
func (r *reconciler) policy(ctx context.Context) (*v1alpha1.DriverUpgradePolicySpec, bool, error) {
	cp := &unstructured.Unstructured{}
	cp.SetGroupVersionKind(clusterPolicyGVK)
	if err := r.Get(ctx, types.NamespacedName{Name: r.clusterPolicy}, cp); err != nil {
		return nil, false, err
	}
	sandbox, _, _ := unstructured.NestedBool(cp.Object, "spec", "sandboxWorkloads", "enabled")
	raw, found, err := unstructured.NestedMap(cp.Object, "spec", "driver", "upgradePolicy")
	if err != nil || !found {
		return nil, sandbox, err
	}
	text, err := json.Marshal(raw)
	if err != nil {
		return nil, sandbox, err
	}
	policy := &v1alpha1.DriverUpgradePolicySpec{}
	if err := json.Unmarshal(text, policy); err != nil {
		return nil, sandbox, fmt.Errorf("spec.driver.upgradePolicy: %w", err)
	}
	return policy, sandbox, nil
}

func (r *reconciler) Reconcile(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	policy, sandbox, err := r.policy(ctx)
	if apierrors.IsNotFound(err) {
		return reconcile.Result{}, nil
	}
	if err != nil {
		return reconcile.Result{}, err
	}
	if sandbox || policy == nil || !policy.AutoUpgrade {
		log.Info("driver auto upgrade is off: removing the upgrade state label from every node")
		return reconcile.Result{}, r.removeStateLabels(ctx)
	}
	state, err := r.manager.BuildState(ctx, r.namespace, map[string]string{driverLabelKey: driverLabelValue})
	if err != nil {
		log.Error(err, "Failed to build cluster upgrade state")
		return reconcile.Result{}, err
	}
	if policy.DrainSpec == nil {
		policy.DrainSpec = &v1alpha1.DrainSpec{}
	}
	if policy.DrainSpec.PodSelector == "" {
		policy.DrainSpec.PodSelector = skipDrainLabelSelector
	} else {
		policy.DrainSpec.PodSelector = policy.DrainSpec.PodSelector + "," + skipDrainLabelSelector
	}
	if err := r.manager.ApplyState(ctx, state, policy); err != nil {
		log.Error(err, "Failed to apply cluster upgrade state")
		return reconcile.Result{}, err
	}
	return reconcile.Result{RequeueAfter: r.requeue}, nil
}

func (r *reconciler) removeStateLabels(ctx context.Context) error {
	nodes := &corev1.NodeList{}
	if err := r.List(ctx, nodes); err != nil {
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
	clusterPolicy := flag.String("cluster-policy", "cluster-policy", "the ClusterPolicy whose upgrade policy applies")
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

	r := &reconciler{Client: mgr.GetClient(), manager: manager, namespace: *namespace,
		clusterPolicy: *clusterPolicy, requeue: *requeue}
	one := handler.EnqueueRequestsFromMapFunc(func(context.Context, client.Object) []reconcile.Request {
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Name: *clusterPolicy}}}
	})
	cp := &unstructured.Unstructured{}
	cp.SetGroupVersionKind(clusterPolicyGVK)
	driverDaemonSet := predicate.NewPredicateFuncs(func(o client.Object) bool {
		return o.GetNamespace() == *namespace && o.GetLabels()[driverLabelKey] == driverLabelValue
	})
	err = ctrl.NewControllerManagedBy(mgr).
		Named("upgrade-controller").
		WithOptions(controller.Options{MaxConcurrentReconciles: 1}).
		Watches(cp, one, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
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
