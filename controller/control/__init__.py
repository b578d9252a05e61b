"""The control loop: observe -> decide (a policy) -> normalize -> apply (the actuator), then subscribers."""
