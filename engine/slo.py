"""A request's latency targets, as its router's SLO class sets them: the one form they take
inside the engine (seconds). On the wire they are one proto message, SLOTargets, in
milliseconds (services/common/slo.py converts, in one place)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from pdserve.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SLOTargets:
    """Each 0 when the request has none."""
    # seconds left to the first token's target when the request was sent (a prefill worker's
    # request: the class's TTFT target less the time already spent): srpt lets newer prompts
    # overtake it only while it can still meet that (engine/core/prefill_order.py)
    ttft_budget_s: float = 0.0
    # the tightest TTFT target among the sending router's SLO classes: what a request
    # arriving behind it may need, so how long a step may last (engine/core/step_bound.py)
    min_class_ttft_s: float = 0.0
    # the mean inter-token time its stream keeps, the class's ITL target: the engine reports
    # its streams' room under it (EngineStats.tpot_stall_room_ms, engine/core/tpot_room.py)
    itl_target_s: float = 0.0

    def validate(self, field_prefix: str = "slo.") -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (value >= 0 and math.isfinite(value)):
                raise InvalidRequestError(field_prefix + f.name, f"must be a finite number >= 0 (0: none), "
                                                                  f"got {value!r}")

    def spent(self, seconds: float) -> SLOTargets:
        """The targets once `seconds` of the TTFT budget have gone by (none left and none
        given alike: 0, the prefill order then ranks it by length alone)."""
        left = max(0.0, self.ttft_budget_s - seconds) if self.ttft_budget_s else 0.0
        return dataclasses.replace(self, ttft_budget_s=left)


NO_SLO = SLOTargets()
