"""Profiles: what a hardware + model costs, as TOML files the twin runs on and the online fit starts from.

``load.py`` is the format and its loader: a profile's ``[cost]`` table (the step's coefficients,
``policies/cost.StepCoefficients``, and the front end's ``frontend_s``), its ``[engine]`` limits (the vLLM
settings the coefficients were fitted under, ``EngineLimits``), its optional ``[fit]`` and ``[variance]``
tables (``Variance``); ``load_profile`` finds a shipped profile by name or reads a path,
``dump_profile`` writes one (``bench calibrate``). ``quantiles.py`` holds the ``[variance]`` tables
(quantile tables sampled by inverse CDF, one per in-flight level). The shipped profiles are this
folder's ``*.toml`` files, package data (``pyproject.toml``), so an installed wheel finds them by name.
Readers: the twin (``simulate --profile NAME``), the control core (``[control] cost_profile`` seeds the
step-cost model), the config's check that the named profile loads, and ``bench calibrate``. May import
``policies/`` (the cost vocabulary) and nothing of ``controller/``.
"""
