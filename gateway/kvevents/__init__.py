"""Engine KV cache events: intake (ZMQ), a precise per-replica block index, and the bridge
from prompts to the engines' token blocks (see docs/kvevents.md)."""
