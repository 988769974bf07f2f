"""Objects as the API server serves them (``kubectl get -o json``), for plan at scale.

gpu-operator's DCGM and exporter pods carry init containers, a dozen environment variables,
host-path volumes, tolerations, node affinity, a full status and the managedFields of
kube-controller-manager (the spec) and the kubelet (the status): 10 to 30 KiB of JSON each,
against a few hundred bytes in tests/worlds.py, the one builder these start from (its CRs,
its labels, its DaemonSets with what the API server adds). Used by benchmarks/bench_plan.py
and the tests that compare the JSON and YAML paths of ``shared-svc plan``.
"""

from __future__ import annotations

import random
from typing import Any

from tests.worlds import APPS, NS, app_labels, cluster_policy, daemonset, gc_spec, gpu_cluster

_TS = "2024-03-0{d}T1{h}:2{m}:3{s}Z"


def _ts(rng: random.Random) -> str:
    return _TS.format(
        d=rng.randint(1, 9), h=rng.randint(0, 9), m=rng.randint(0, 9), s=rng.randint(0, 9)
    )


def _uid(rng: random.Random) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _fields(value: Any) -> Any:
    """A fieldsV1 tree for ``value`` (maps as f:, lists of named maps as k:, others as .)."""
    if isinstance(value, dict):
        return {f"f:{k}": _fields(v) for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out: dict[str, Any] = {".": {}}
        for item in value:
            key = item.get("name") or item.get("key") or item.get("type") or item.get("mountPath")
            name = "name" if "name" in item else "key" if "key" in item else "type"
            out[f'k:{{"{name}":"{key}"}}'] = {".": {}, **_fields(item)}
        return out
    return {}


def _container(app: str, rng: random.Random, index: int) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": f"DCGM_SETTING_{i}", "value": f"value-{rng.getrandbits(40):x}"} for i in range(12)
    ]
    env.append(
        {
            "name": "NODE_NAME",
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}},
        }
    )
    mounts = [
        {"name": f"vol-{i}", "mountPath": f"/var/lib/{app}/m{i}", "readOnly": i % 2 == 0}
        for i in range(6)
    ]
    mounts.append(
        {
            "name": "kube-api-access",
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True,
        }
    )
    return {
        "name": app if index == 0 else f"{app}-sidecar-{index}",
        "image": f"nvcr.io/nvidia/k8s/{app}:3.3.{rng.randint(0, 9)}-4.{rng.randint(0, 9)}.0-ubuntu22.04",
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "-f",
            "/etc/dcgm-exporter/dcp-metrics-included.csv",
            "--kubernetes-gpu-id-type",
            "device-name",
        ],
        "env": env,
        "ports": [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}],
        "resources": {},
        "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "volumeMounts": mounts,
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": 9400, "scheme": "HTTP"},
            "initialDelaySeconds": 45,
            "periodSeconds": 5,
            "timeoutSeconds": 1,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
    }


def api_pod(
    app: str, name: str, node: str, *, common: bool = True, seed: int = 0
) -> dict[str, Any]:
    """A DaemonSet pod of ``app`` on ``node``, Ready, with everything the API adds."""
    rng = random.Random(f"{app}/{name}/{seed}")
    labels = {
        "app": app,
        "controller-revision-hash": f"{rng.getrandbits(40):x}",
        "pod-template-generation": "1",
        "app.kubernetes.io/managed-by": "gpu-operator",
        "helm.sh/chart": "gpu-operator-v24.9.0",
    }
    labels.update(app_labels(app, common=common))  # worlds.py's, the common label last
    containers = [_container(app, rng, i) for i in range(rng.choice((1, 1, 2)))]
    init = [
        {
            "name": "toolkit-validation",
            "image": "nvcr.io/nvidia/cloud-native/gpu-operator-validator:v24.9.0",
            "command": ["sh", "-c"],
            "args": ["until [ -f /run/nvidia/validations/toolkit-ready ]; do sleep 5; done"],
            "resources": {},
            "securityContext": {"privileged": True},
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "File",
            "volumeMounts": [
                {
                    "name": "run-nvidia",
                    "mountPath": "/run/nvidia",
                    "mountPropagation": "HostToContainer",
                }
            ],
        }
    ]
    volumes = [
        {
            "name": f"vol-{i}",
            "hostPath": {"path": f"/var/lib/{app}/m{i}", "type": "DirectoryOrCreate"},
        }
        for i in range(6)
    ]
    volumes.append({"name": "run-nvidia", "hostPath": {"path": "/run/nvidia", "type": "Directory"}})
    spec = {
        "containers": containers,
        "initContainers": init,
        "volumes": volumes,
        "dnsPolicy": "ClusterFirst",
        "enableServiceLinks": True,
        "nodeName": node,
        "nodeSelector": {"nvidia.com/gpu.deploy.dcgm-exporter": "true"},
        "preemptionPolicy": "PreemptLowerPriority",
        "priority": 2000001000,
        "priorityClassName": "system-node-critical",
        "restartPolicy": "Always",
        "runtimeClassName": "nvidia",
        "schedulerName": "default-scheduler",
        "securityContext": {},
        "serviceAccount": "nvidia-dcgm-exporter",
        "serviceAccountName": "nvidia-dcgm-exporter",
        "terminationGracePeriodSeconds": 30,
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        },
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            *(
                {"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": e}
                for t, e in (
                    ("not-ready", "NoExecute"),
                    ("unreachable", "NoExecute"),
                    ("disk-pressure", "NoSchedule"),
                    ("memory-pressure", "NoSchedule"),
                    ("pid-pressure", "NoSchedule"),
                    ("unschedulable", "NoSchedule"),
                )
            ),
        ],
    }
    started = _ts(rng)
    status = {
        "phase": "Running",
        "conditions": [
            {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": started}
            for t in (
                "PodReadyToStartContainers",
                "Initialized",
                "Ready",
                "ContainersReady",
                "PodScheduled",
            )
        ],
        "hostIP": f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
        "hostIPs": [{"ip": "10.0.0.1"}],
        "podIP": f"192.168.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
        "podIPs": [{"ip": "192.168.0.1"}],
        "qosClass": "BestEffort",
        "startTime": started,
        "initContainerStatuses": [
            {
                "name": "toolkit-validation",
                "image": init[0]["image"],
                "imageID": f"nvcr.io/nvidia/cloud-native/gpu-operator-validator@sha256:{rng.getrandbits(256):064x}",
                "containerID": f"containerd://{rng.getrandbits(256):064x}",
                "ready": True,
                "restartCount": 0,
                "started": False,
                "state": {
                    "terminated": {
                        "exitCode": 0,
                        "reason": "Completed",
                        "startedAt": started,
                        "finishedAt": started,
                        "containerID": "containerd://x",
                    }
                },
                "lastState": {},
            }
        ],
        "containerStatuses": [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": f"{c['image'].split(':')[0]}@sha256:{rng.getrandbits(256):064x}",
                "containerID": f"containerd://{rng.getrandbits(256):064x}",
                "ready": True,
                "restartCount": rng.randint(0, 3),
                "started": True,
                "state": {"running": {"startedAt": started}},
                "lastState": {},
                "volumeMounts": [
                    {"name": m["name"], "mountPath": m["mountPath"]} for m in c["volumeMounts"]
                ],
            }
            for c in containers
        ],
    }
    ds_uid = f"uid-ds-{app}"
    owner = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "name": app,
        "uid": ds_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    managed = [
        {
            "manager": "kube-controller-manager",
            "operation": "Update",
            "apiVersion": "v1",
            "time": started,
            "fieldsType": "FieldsV1",
            "fieldsV1": {
                "f:metadata": {
                    "f:generateName": {},
                    "f:labels": _fields(labels),
                    "f:ownerReferences": {".": {}, f'k:{{"uid":"{ds_uid}"}}': {}},
                },
                "f:spec": _fields(spec),
            },
        },
        {
            "manager": "kubelet",
            "operation": "Update",
            "apiVersion": "v1",
            "time": started,
            "fieldsType": "FieldsV1",
            "subresource": "status",
            "fieldsV1": {"f:status": _fields(status)},
        },
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "generateName": f"{app}-",
            "namespace": NS,
            "uid": _uid(rng),
            "resourceVersion": str(rng.randint(1000, 10**7)),
            "creationTimestamp": started,
            "labels": labels,
            "annotations": {"kubectl.kubernetes.io/default-container": app},
            "ownerReferences": [owner],
            "managedFields": managed,
        },
        "spec": spec,
        "status": status,
    }


def api_daemonset(app: str, desired: int, *, common: bool = True) -> dict[str, Any]:
    """``worlds.daemonset`` (a complete rollout) with what the API server adds."""
    ds = daemonset(app, common=common, desired=desired)
    ds["metadata"].update(
        resourceVersion="4242",
        creationTimestamp="2024-03-01T00:00:00Z",
        labels={"app": app, "app.kubernetes.io/managed-by": "gpu-operator"},
    )
    ds["spec"]["updateStrategy"]["rollingUpdate"] = {"maxUnavailable": 1}
    ds["spec"]["template"]["spec"] = {"containers": []}
    ds["status"] = {
        "observedGeneration": 1,
        "desiredNumberScheduled": desired,
        "currentNumberScheduled": desired,
        "updatedNumberScheduled": desired,
        "numberAvailable": desired,
        "numberReady": desired,
        "numberMisscheduled": 0,
    }
    return ds


def pod_list(pods: int, *, seed: int = 0) -> dict[str, Any]:
    """Both CRs, four DaemonSets and ``pods`` pods spread over them (one straggler each),
    as one ``kind: List`` (what ``kubectl get ... -o json`` prints)."""
    per_app = max(1, pods // len(APPS))
    items: list[dict[str, Any]] = [
        cluster_policy(),
        gpu_cluster(spec=gc_spec(monitor={"enabled": True})),
    ]
    for app in APPS.values():
        items.append(api_daemonset(app, per_app))
        items.extend(
            api_pod(app, f"{app}-{i:05d}", f"node-{i:05d}", common=i != per_app - 1, seed=seed)
            for i in range(per_app)
        )
    return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": items}


# What a GPU node carries besides the hostname: node-feature-discovery's and
# gpu-feature-discovery's labels (a few of each kind, as a DGX-class node shows them).
_GPU_NODE_LABELS = {
    "beta.kubernetes.io/arch": "amd64",
    "beta.kubernetes.io/os": "linux",
    "kubernetes.io/arch": "amd64",
    "kubernetes.io/os": "linux",
    "node.kubernetes.io/instance-type": "p4d.24xlarge",
    "topology.kubernetes.io/region": "us-east-1",
    "topology.kubernetes.io/zone": "us-east-1a",
    "feature.node.kubernetes.io/cpu-cpuid.AVX512F": "true",
    "feature.node.kubernetes.io/cpu-cpuid.AVX512VNNI": "true",
    "feature.node.kubernetes.io/cpu-model.family": "6",
    "feature.node.kubernetes.io/cpu-model.id": "85",
    "feature.node.kubernetes.io/cpu-model.vendor_id": "Intel",
    "feature.node.kubernetes.io/kernel-version.full": "5.15.0-1063-aws",
    "feature.node.kubernetes.io/kernel-version.major": "5",
    "feature.node.kubernetes.io/pci-10de.present": "true",
    "feature.node.kubernetes.io/pci-1d0f.present": "true",
    "feature.node.kubernetes.io/system-os_release.ID": "ubuntu",
    "feature.node.kubernetes.io/system-os_release.VERSION_ID": "22.04",
    "nvidia.com/cuda.driver.major": "550",
    "nvidia.com/cuda.driver.minor": "90",
    "nvidia.com/cuda.driver.rev": "07",
    "nvidia.com/cuda.runtime.major": "12",
    "nvidia.com/cuda.runtime.minor": "4",
    "nvidia.com/gfd.timestamp": "1709650000",
    "nvidia.com/gpu.compute.major": "8",
    "nvidia.com/gpu.compute.minor": "0",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.deploy.container-toolkit": "true",
    "nvidia.com/gpu.deploy.dcgm": "true",
    "nvidia.com/gpu.deploy.dcgm-exporter": "true",
    "nvidia.com/gpu.deploy.device-plugin": "true",
    "nvidia.com/gpu.deploy.driver": "true",
    "nvidia.com/gpu.deploy.gpu-feature-discovery": "true",
    "nvidia.com/gpu.deploy.node-status-exporter": "true",
    "nvidia.com/gpu.deploy.operator-validator": "true",
    "nvidia.com/gpu.family": "ampere",
    "nvidia.com/gpu.machine": "p4d.24xlarge",
    "nvidia.com/gpu.memory": "40960",
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
    "nvidia.com/gpu.replicas": "1",
    "nvidia.com/mig.capable": "true",
    "nvidia.com/mig.strategy": "single",
}


def api_node_status(name: str, *, seed: int = 0) -> dict[str, Any]:
    """A GPU node's status as its kubelet writes it: capacity, conditions, addresses,
    nodeInfo and the images on the node (about 8 KiB of JSON; with the labels,
    annotations and managedFields the API server adds, a Node of about 15 KiB)."""
    rng = random.Random(f"node/{name}/{seed}")
    capacity = {
        "cpu": "96",
        "ephemeral-storage": "1048576000Ki",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "0",
        "memory": "1176481748Ki",
        "nvidia.com/gpu": "8",
        "pods": "110",
        "vpc.amazonaws.com/efa": "4",
    }
    beat = _ts(rng)
    conditions = [
        {
            "type": kind,
            "status": "False",
            "lastHeartbeatTime": beat,
            "lastTransitionTime": _ts(rng),
            "reason": f"Kubelet{reason}",
            "message": f"kubelet has {message}",
        }
        for kind, reason, message in (
            ("MemoryPressure", "HasSufficientMemory", "sufficient memory available"),
            ("DiskPressure", "HasNoDiskPressure", "no disk pressure"),
            ("PIDPressure", "HasSufficientPID", "sufficient PID available"),
        )
    ]
    conditions.append(
        {
            "type": "Ready",
            "status": "True",
            "lastHeartbeatTime": beat,
            "lastTransitionTime": _ts(rng),
            "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
        }
    )
    repos = [
        "nvcr.io/nvidia/driver",
        "nvcr.io/nvidia/k8s/container-toolkit",
        "nvcr.io/nvidia/k8s-device-plugin",
        "nvcr.io/nvidia/k8s/dcgm-exporter",
        "nvcr.io/nvidia/cloud-native/dcgm",
        "nvcr.io/nvidia/gpu-feature-discovery",
        "nvcr.io/nvidia/cloud-native/gpu-operator-validator",
        "registry.k8s.io/nfd/node-feature-discovery",
        "nvcr.io/nvidia/pytorch",
        "nvcr.io/nvidia/tritonserver",
        "nvcr.io/nvidia/nemo",
        "public.ecr.aws/eks/aws-efa-k8s-device-plugin",
        "registry.k8s.io/kube-proxy",
        "public.ecr.aws/amazon-k8s-cni",
        "registry.k8s.io/pause",
    ]
    images = [
        {
            "names": [
                f"{repo}@sha256:{rng.getrandbits(256):064x}",
                f"{repo}:v{rng.randint(1, 30)}.{rng.randint(0, 12)}.{rng.randint(0, 9)}",
            ],
            "sizeBytes": rng.randint(700_000, 20_000_000_000),
        }
        for repo in repos
        for _ in range(2)
    ]
    ip = f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
    return {
        "capacity": capacity,
        "allocatable": {**capacity, "cpu": "95690m", "memory": "1175460756Ki"},
        "conditions": conditions,
        "addresses": [
            {"type": "InternalIP", "address": ip},
            {"type": "InternalDNS", "address": f"ip-{ip.replace('.', '-')}.ec2.internal"},
            {"type": "Hostname", "address": name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
            "machineID": f"{rng.getrandbits(128):032x}",
            "systemUUID": _uid(rng),
            "bootID": _uid(rng),
            "kernelVersion": "5.15.0-1063-aws",
            "osImage": "Ubuntu 22.04.4 LTS",
            "containerRuntimeVersion": "containerd://1.7.13",
            "kubeletVersion": "v1.36.3",
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
        "images": images,
    }


def api_node_labels(name: str) -> dict[str, str]:
    """A GPU node's labels: the hostname and the discovery labels."""
    return {"kubernetes.io/hostname": name, **_GPU_NODE_LABELS}
