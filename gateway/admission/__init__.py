"""Priority classes and shortest-remaining-first admission in front of saturated replicas.

Pure parts: `config` (settings), `order` (ranking), `saturation` (is a replica full),
`classes` (class resolution, vLLM `priority` mapping). Async part: `queue` (the waiting
room). `gate.AdmissionGate` is what the proxy talks to.
"""

from gateway.admission.config import AdmissionSettings, PriorityClass, SaturationThresholds

__all__ = ["AdmissionSettings", "PriorityClass", "SaturationThresholds"]
