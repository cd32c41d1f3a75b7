"""Heterogeneous card pools: placement constraints, dynamic traffic weights, cost per token.

Pure parts (`placement`, `controller.step`, `cost`) carry no I/O; `runtime.PoolsRuntime`
wires them into an app (selector around the router, controller task, cost observer).
"""
