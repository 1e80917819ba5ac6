"""BEMA as the reference (Block & Zhang 2025, "EMA Without the Lag: Bias-Corrected Iterate Averaging", arXiv
2508.00180): ``reference_update=bema`` makes the reference a bias-corrected exponential moving average of the policy's
weights, as TRL's ``BEMACallback(update_ref_model=True)`` does, with its keys and defaults (config/reference_update/bema.yaml)."""

from __future__ import annotations

import torch

import losses

KEYS = ("update_freq", "lag", "update_after", "ref_model_update_freq", "ref_model_update_after")  # whole numbers
POWERS = ("ema_power", "bias_power", "multiplier", "min_ema_multiplier")  # real numbers >= 0


class BEMAUpdate:
    """theta'_t = EMA_t + alpha_t (theta_t - theta_0), EMA_t = (1 - beta_t) EMA_{t-1} + beta_t theta_t, with
    beta_t = max((lag + multiplier t)^-ema_power, min_ema_multiplier) and alpha_t = (lag + multiplier t)^-bias_power
    (the paper's Eq. 2; TRL's BEMACallback), updated every ``update_freq`` steps after ``update_after``; the reference
    takes theta' every ``ref_model_update_freq`` steps from ``ref_model_update_after`` on."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.update = trainer.config.reference_update
        trainer.dist.reshard(trainer.policy)  # FSDP2 roots keep weights gathered after a no-grad forward
        policy = trainer.policy.named_parameters()
        self.names = [name for name, p in policy if p.requires_grad]  # the trained weights; the others never move
        params = dict(trainer.policy.named_parameters())
        copy = {name: params[name].detach().clone() for name in self.names}
        self.theta0 = copy  # theta_0, the policy at update_after (at the start until then)
        self.ema = {name: t.clone() for name, t in copy.items()}  # the EMA starts at theta_0
        self.running = {name: t.clone() for name, t in copy.items()}  # theta', what the reference takes

    @staticmethod
    def check(update) -> str | None:
        """One sentence on a missing or wrong BEMA key, else None."""
        missing = [k for k in (*KEYS, *POWERS) if k not in update]
        if missing:
            return f"reference_update.mode=bema needs its keys ({', '.join(missing)}); select them with reference_update=bema."
        extra = next((key for key in update if key not in ("mode", *KEYS, *POWERS)), None)
        if extra is not None:  # another mode's key (TR-DPO's), which BEMA would never read
            return (
                f"reference_update.{extra} is not a key of reference_update.mode=bema (its keys: {', '.join((*KEYS, *POWERS))}); "
                "remove it (each mode's keys come with its config: reference_update=tr_dpo or reference_update=bema)."
            )
        for key in KEYS:
            value, least = update[key], 1 if key.endswith("freq") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                return f"reference_update.{key} must be a whole number of optimizer steps >= {least}, got {value}."
        for key in POWERS:
            value = update[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                return f"reference_update.{key} must be a number >= 0, got {value}."
        if update.lag + update.multiplier == 0:
            return "reference_update.lag and multiplier are both 0, so (lag + multiplier * t) is 0 at t = 0; raise one."
        return None

    def beta(self, step: int) -> float:
        """The EMA's weight of the newest iterate, beta_t = max((lag + multiplier t)^-ema_power, min_ema_multiplier)."""
        u = self.update
        return max((u.lag + u.multiplier * step) ** (-u.ema_power), u.min_ema_multiplier)

    def alpha(self, step: int) -> float:
        """The bias correction's weight, alpha_t = (lag + multiplier t)^-bias_power."""
        u = self.update
        return (u.lag + u.multiplier * step) ** (-u.bias_power)

    @torch.no_grad()
    def step(self, step: int) -> dict:
        """After optimizer step ``step`` (1-based, TRL's ``global_step``): snapshot, or update theta', then copy it
        into the reference when due; returns the reference's updates so far."""
        u, trainer = self.update, self.trainer
        for model in (trainer.policy, trainer.reference_model):  # shards again after the step's no-grad forwards
            trainer.dist.reshard(model)
        params = dict(trainer.policy.named_parameters())
        if step == u.update_after:
            for name in self.names:
                self.theta0[name].copy_(params[name])
                self.ema[name].copy_(params[name])
        elif step > u.update_after and (step - u.update_after) % u.update_freq == 0:
            beta, alpha = self.beta(step), self.alpha(step)
            for name in self.names:
                theta = params[name].detach()
                self.ema[name].mul_(1 - beta).add_(theta, alpha=beta)
                self.running[name].copy_(self.ema[name] + alpha * (theta - self.theta0[name]))
        after, every = u.ref_model_update_after, u.ref_model_update_freq
        if step >= after and (step - after) % every == 0:
            reference = dict(trainer.reference_model.named_parameters())
            for name in self.names:
                reference[name].copy_(self.running[name].to(reference[name].dtype))
        first = max(after, 1) if after else every  # step 0 is never an optimizer step
        updates = 0 if step < first else (step - first) // every + 1
        return {"counters/reference_updates": float(updates)}

    def state_dict(self) -> dict:
        """theta_0, the EMA and theta' (sharded like the policy under FSDP and TP), which resume needs."""
        return {"theta0": self.theta0, "ema": self.ema, "running": self.running}

    def load_state_dict(self, state: dict) -> None:
        """Copy a checkpoint's :meth:`state_dict` into this run's tensors."""
        for part in ("theta0", "ema", "running"):
            mine = getattr(self, part)
            for name, value in state[part].items():
                if mine[name] is not value:  # DCP has filled this run's own tensors already
                    mine[name].copy_(value)


losses.REFERENCE_UPDATES["bema"] = BEMAUpdate
