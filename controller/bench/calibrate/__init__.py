"""``bench calibrate`` and ``bench validate``: the twin's profile fitted against a real server
(``run.py``: the method and the command, ``measure.py``: the loads sent, ``fit.py``: the least squares)
and the twin checked against the real engine (``validate.py``)."""
