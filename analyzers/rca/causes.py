"""The fixed vocabulary of causes a verdict can name (docs/rca.md describes each).

A cause is a string from CAUSES; the JSON verdict and the Prometheus label carry it as is.
"""

from __future__ import annotations

CPU_STARVATION = "cpu_starvation"
HOST_MEMORY_PRESSURE = "host_memory_pressure"
NETWORK_DELAY = "network_delay"
NETWORK_LOSS = "network_loss"
PCIE_CONTENTION = "pcie_contention"
GPU_COMPUTE_CONTENTION = "gpu_compute_contention"
GPU_THROTTLING = "gpu_throttling"
GPU_MEMORY_PRESSURE = "gpu_memory_pressure"
REQUEST_MIX_SHIFT = "request_mix_shift"
SERVER_QUEUEING = "server_queueing"
SLOW_DEPENDENCY = "slow_dependency"
UNKNOWN = "unknown"

# what each cause means, in the words docs/rca.md and `sits-trace rca --help` use
CAUSES: dict[str, str] = {
    CPU_STARVATION: "the serving threads waited in the run queue: another process took the CPU",
    HOST_MEMORY_PRESSURE: "the host ran short of memory: page reclaim and faults stalled the server",
    NETWORK_DELAY: "round trips between the service and its peer got longer",
    NETWORK_LOSS: "segments were lost and retransmitted on the service's connections",
    PCIE_CONTENTION: "host<->device copies slowed by another process's transfers",
    GPU_COMPUTE_CONTENTION: "another process's kernels shared the GPU",
    GPU_THROTTLING: "the GPU's clocks were held down (power, thermal, ...)",
    GPU_MEMORY_PRESSURE: "the GPU's memory was nearly full",
    REQUEST_MIX_SHIFT: "requests got bigger: longer prompts or outputs",
    SERVER_QUEUEING: "requests arrived faster than the server serves them and queued",
    SLOW_DEPENDENCY: "an outgoing call the service makes got slow",
    UNKNOWN: "no signal the agent has explains the increase",
}
VOCABULARY: tuple[str, ...] = tuple(CAUSES)
