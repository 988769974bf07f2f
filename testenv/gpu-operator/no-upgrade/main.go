// gpu-operator without its upgrade controller: the soak's gpu-operator (tests/soak/).
//
// The gpu-operator that testenv builds (../version) predates v26.7.0, whose upgrade
// controller testenv/upgrade-libs/ plays with the libs v26.7.0 vendors. Its own upgrade
// controller runs older libs (no restart-only path) and reconciles every ClusterPolicy,
// removing the upgrade-state label from every node for any one without autoUpgrade: next
// to upgrade-libs it would be a second, older upgrade controller on the same driver pods.
// This main is gpu-operator's cmd/gpu-operator/main.go at that version with the upgrade
// controller left out and nothing else changed (its ClusterPolicy and NVIDIADriver
// controllers, the same scheme, cache, probes and metrics); the two constants it takes
// from the module's internal packages are written here.
package main

import (
	"flag"
	"os"
	"time"

	_ "k8s.io/client-go/plugin/pkg/client/auth"
	"sigs.k8s.io/controller-runtime/pkg/cache"

	apiconfigv1 "github.com/openshift/api/config/v1"
	apiimagev1 "github.com/openshift/api/image/v1"
	secv1 "github.com/openshift/api/security/v1"
	promv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"go.uber.org/zap/zapcore"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/webhook"

	clusterpolicyv1 "github.com/NVIDIA/gpu-operator/api/nvidia/v1"
	nvidiav1alpha1 "github.com/NVIDIA/gpu-operator/api/nvidia/v1alpha1"
	"github.com/NVIDIA/gpu-operator/controllers"
	"github.com/NVIDIA/gpu-operator/controllers/clusterinfo"
)

// internal/consts.OpenshiftNamespace of the module.
const openshiftNamespace = "openshift"

var (
	scheme   = runtime.NewScheme()
	setupLog = ctrl.Log.WithName("setup")
)

func init() {
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(clusterpolicyv1.AddToScheme(scheme))
	utilruntime.Must(apiextensionsv1.AddToScheme(scheme))
	utilruntime.Must(nvidiav1alpha1.AddToScheme(scheme))
	utilruntime.Must(promv1.AddToScheme(scheme))
	utilruntime.Must(secv1.Install(scheme))
	utilruntime.Must(apiconfigv1.Install(scheme))
	utilruntime.Must(apiimagev1.Install(scheme))
}

func main() {
	var metricsAddr, probeAddr string
	var enableLeaderElection bool
	var renewDeadline time.Duration
	flag.StringVar(&metricsAddr, "metrics-bind-address", ":8080", "The address the metric endpoint binds to.")
	flag.StringVar(&probeAddr, "health-probe-bind-address", ":8081", "The address the probe endpoint binds to.")
	flag.BoolVar(&enableLeaderElection, "leader-elect", false, "Enable leader election for controller manager.")
	flag.DurationVar(&renewDeadline, "leader-lease-renew-deadline", 0, "The leader lease renew deadline (with --leader-elect).")
	opts := zap.Options{StacktraceLevel: zapcore.PanicLevel}
	opts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts)))

	operatorNamespace := os.Getenv("OPERATOR_NAMESPACE")
	options := ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: metricsAddr},
		HealthProbeBindAddress: probeAddr,
		LeaderElection:         enableLeaderElection,
		LeaderElectionID:       "53822513.nvidia.com",
		WebhookServer:          webhook.NewServer(webhook.Options{Port: 9443}),
		Cache: cache.Options{DefaultNamespaces: map[string]cache.Config{
			operatorNamespace:  {},
			openshiftNamespace: {},
		}},
	}
	if enableLeaderElection && renewDeadline != 0 {
		leaseDuration := renewDeadline + 5*time.Second
		options.RenewDeadline = &renewDeadline
		options.LeaseDuration = &leaseDuration
	}
	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), options)
	if err != nil {
		setupLog.Error(err, "unable to start manager")
		os.Exit(1)
	}
	ctx := ctrl.SetupSignalHandler()
	if err = (&controllers.ClusterPolicyReconciler{
		Client: mgr.GetClient(),
		Log:    ctrl.Log.WithName("controllers").WithName("ClusterPolicy"),
		Scheme: mgr.GetScheme(),
	}).SetupWithManager(ctx, mgr); err != nil {
		setupLog.Error(err, "unable to create controller", "controller", "ClusterPolicy")
		os.Exit(1)
	}
	// Left out here: gpu-operator's UpgradeReconciler (see the file's comment).
	clusterInfo, err := clusterinfo.New(
		ctx,
		clusterinfo.WithKubernetesConfig(mgr.GetConfig()),
		clusterinfo.WithOneShot(false),
	)
	if err != nil {
		setupLog.Error(err, "failed to get cluster wide information needed by controllers")
		os.Exit(1)
	}
	if err = (&controllers.NVIDIADriverReconciler{
		Client:      mgr.GetClient(),
		Scheme:      mgr.GetScheme(),
		ClusterInfo: clusterInfo,
	}).SetupWithManager(ctx, mgr); err != nil {
		setupLog.Error(err, "unable to create controller", "controller", "NVIDIADriver")
		os.Exit(1)
	}
	if err := mgr.AddHealthzCheck("health", healthz.Ping); err != nil {
		setupLog.Error(err, "unable to set up health check")
		os.Exit(1)
	}
	if err := mgr.AddReadyzCheck("check", healthz.Ping); err != nil {
		setupLog.Error(err, "unable to set up ready check")
		os.Exit(1)
	}
	setupLog.Info("starting manager")
	if err := mgr.Start(ctx); err != nil {
		setupLog.Error(err, "problem running manager")
		os.Exit(1)
	}
}
