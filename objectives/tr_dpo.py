"""TR-DPO (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment", Sec. 3): move the reference
toward the policy every tau = ``reference_update.every`` optimizer steps, ``soft`` (theta_ref <- alpha * theta +
(1 - alpha) * theta_ref) or ``hard`` (theta_ref <- theta), for any objective with a reference."""

from __future__ import annotations

import torch

import losses


@torch.no_grad()
def update_reference(trainer, mode: str, alpha: float) -> None:
    """TR-DPO's update of ``trainer.reference_model`` from ``trainer.policy``: ``soft`` theta_ref <- alpha * theta +
    (1 - alpha) * theta_ref, ``hard`` theta_ref <- theta (alpha ignored)."""
    if trainer.reference_model is None:
        raise RuntimeError("reference_update needs the reference model in this process; none is loaded.")
    for model in (trainer.policy, trainer.reference_model):  # FSDP2 roots keep weights gathered after a no-grad forward
        trainer.dist.reshard(model)
    policy = dict(trainer.policy.named_parameters())  # sharded alike (FSDP, TP): nothing is gathered
    for name, ref in trainer.reference_model.named_parameters():
        theta = policy[name].detach()
        theta = theta.to(ref.dtype) if theta.dtype != ref.dtype else theta
        if mode == "hard":
            ref.copy_(theta)
        else:
            ref.mul_(1.0 - alpha).add_(theta, alpha=alpha)


class TRDPOUpdate:
    """TR-DPO's update every ``reference_update.every`` steps; the train records count the updates (``reference_updates``)."""

    def __init__(self, trainer):
        self.trainer = trainer
        update = trainer.config.reference_update
        self.mode, self.every, self.alpha = update.mode, update.get("every", 1), float(update.get("alpha", 1.0))

    @staticmethod
    def check(update) -> str | None:
        """One sentence on a wrong ``every`` or (``soft``) ``alpha``, else None."""
        own = ("mode", "alpha", "every")
        if "every" not in update:
            return f"reference_update.mode={update.mode} needs its keys (alpha, every); select them with reference_update=tr_dpo."
        extra = next((key for key in update if key not in own), None)
        if extra is not None:  # another mode's key (BEMA's), which TR-DPO would never read
            return (
                f"reference_update.{extra} is not a key of reference_update.mode={update.mode} (its keys: alpha, every); "
                "remove it (each mode's keys come with its config: reference_update=tr_dpo or reference_update=bema)."
            )
        every, alpha = update.get("every"), update.get("alpha")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            return f"reference_update.every must be a whole number of optimizer steps >= 1, got {every}."
        if update.mode == "soft" and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1):
            return f"reference_update.alpha must be in (0, 1] (the policy's weight in the mix), got {alpha}."
        return None

    def step(self, step: int) -> dict:
        """After optimizer step ``step``: update when ``step`` is a multiple of ``every``; returns the updates so far."""
        if step % self.every == 0:
            update_reference(self.trainer, self.mode, self.alpha)
        return {"counters/reference_updates": float(step // self.every)}  # a resumed run counts on

    def state_dict(self) -> dict:
        return {}  # the reference's weights are all TR-DPO's state

    def load_state_dict(self, state: dict) -> None:
        pass


losses.REFERENCE_UPDATES.update(soft=TRDPOUpdate, hard=TRDPOUpdate)
