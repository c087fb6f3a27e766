"""Step times: measuring them on this machine (``measure.py``) and the cost model fitted from them
(``cost_model.py``), which the policy plans with and every service reports into. Depends on the
engine only, so the services, the policy and the benchmarks all import it from below."""
