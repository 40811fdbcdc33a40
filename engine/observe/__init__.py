"""What the engine shows of itself while someone watches: dashboard rows and snapshots
(dashboard.py) and Chrome traces of steps and request lifecycles (trace.py)."""
