"""

``base.py`` (``Observation``, ``Decision``, ``Policy`` with its ``applied`` hook, and ``BUILT_INS``: a
dict of import strings resolved lazily, plus ``"module:Class"`` for outside plug-ins; a policy decides
targets, and the normalize stage clamps, bands, holds reversals and rate-limits them), ``slo_targets.py``
(``SloTargets``: the SLO per class) and ``cost.py`` (the step cost in one vocabulary, which the twin, the
profiles and the online fit share: ``StepCoefficients`` and its one formula ``step_s(P, D, K)``,
``knee_batch``, and ``CostEstimate``, the step-cost fit a policy predicts with), ``knobs.py`` (``Knob``:
each knob's one name, vLLM's and its gauge's, and the bounds every clamp of a knob uses, here so the
policies reach them too), ``common.py`` (``CapFollower``: the parameters the cap-following policies
share, defined once), and
the policies: ``static``, ``hysteresis``, ``pid``, ``slo`` (``slo_policy.py``: the default, steering to
``[slo]`` from the step-cost model with a mean margin learned from the share of served requests that
missed, or without ``[slo]`` to the throughput knee). Imports nothing from ``controller/``.
"""
