"""The numeric ranges every flag must respect, whatever else validate() asks: finite, representable in float32
where the value meets tensors, within int64, and the advice an error gives keeps to the ranges validate() then takes.
"""

import math
from dataclasses import fields

from dist.errors import UsageError

FLOAT32_TINY, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38   # smallest normal, largest float32

# The float flags validate() requires to be positive, or in [0, 1]: check_finite's advice keeps to them.
POSITIVE_FLOATS = ("--ppo.learning-rate", "--ppo.clip-param", "--ppo.max-grad-norm", "--policy.init-noise-std",
                   "--ppo.desired-kl", "--dist.bucket-mb", "--ppo.adam-eps", "--ppo.reward-clip", "--ppo.lr-min",
                   "--ppo.lr-max")
UNIT_INTERVAL = ("--ppo.gamma", "--ppo.lam", "--env.sampling-uniform-floor")


def flag_value(cfg, flag: str):
    """The value `flag` sets in `cfg`: --ppo.lr-max is cfg.ppo.lr_max, --max-iterations cfg.max_iterations."""
    *section, name = flag[2:].replace("-", "_").split(".")
    return getattr(getattr(cfg, section[0]) if section else cfg, name)


def check_finite(cfg) -> None:
    """Every float field must be finite: NaN or inf in a coefficient trains for hours with every step skipped; and
    0 or representable in float32, where nearly all of them meet tensors (none needs more): beyond its range torch
    raises at first use (clip, reward clip, action clip), below its smallest normal the value is 0 there (a
    grad-norm cap that zeroes every step, Adam's eps: 0/0; the LR: no step). The seconds of the collective timeout
    and of an episode have their own ranges. Every integer (and integer tuple) must fit int64: a larger size or
    count overflows in torch with a traceback."""
    sections = {"": cfg, "env.": cfg.env, "policy.": cfg.policy, "ppo.": cfg.ppo, "dist.": cfg.dist, "log.": cfg.log,
                "rollout.": cfg.rollout}
    for prefix, section in sections.items():
        for f in fields(section):
            value = getattr(section, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"--{prefix}{f.name.replace('_', '-')} must be a finite number, got {value}")
            in_float32 = prefix + f.name not in ("dist.timeout_s", "env.episode_length_s")   # seconds: own ranges
            if in_float32 and isinstance(value, float) and value and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
                flag = f"--{prefix}{f.name.replace('_', '-')}"     # the advice is the range validate() then takes
                zero = "" if flag in (*POSITIVE_FLOATS, "--env.action-scale", "--env.action-clip") else "0 or "
                top = 1 if flag in UNIT_INTERVAL else FLOAT32_MAX
                raise UsageError(f"{flag} {value} is 0 or inf in float32, where it is used; use {zero}a magnitude in "
                                 f"[{FLOAT32_TINY:.1e}, {top:.1e}]")
            ints = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63 for v in ints):
                raise UsageError(f"--{prefix}{f.name.replace('_', '-')} must fit in 64 bits "
                                 f"([-2**63, 2**63 - 1]), got {value}")
