"""Settings shared by the suite's hypothesis state machines."""
import os

from hypothesis import HealthCheck, settings


def machine_settings(examples: int, steps: int) -> settings:
    """A state machine's settings: ``examples`` runs (RTMEM_EXAMPLES raises it
    for a bug hunt) of up to ``steps`` rules each; no deadline (no timing
    assertions), and slow data generation is no failure."""
    return settings(max_examples=int(os.environ.get("RTMEM_EXAMPLES", examples)),
                    stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
