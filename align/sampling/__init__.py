"""The samplers of the online-RL trainer (one file each, named in ``registry.py``) and their maths: DDIM with per-step
log-probabilities (``ddim.py``), the flow-matching SDE/CPS/ODE steps (``flow.py``) and the forward processes
(``forward.py``)."""
