"""evaluate.py's judge: scores each response or asks each pair both ways, caching every answer it gets."""

from __future__ import annotations

import math
import os

import torch
from omegaconf import DictConfig

from evaluation import rewards, sampling
from evaluation.cache import Cache
from evaluation.statistics import combine_orders, compare_scores
from runs import checks
from runs.config_text import digest
from utils import ConfigError

JUDGE_CHUNK = 32  # judge requests (or texts to score) at a time; each chunk's answers are cached before the next


SUMMARY_TEMPLATE = "dpo_summarization_concise"


DIALOGUE_TEMPLATE = "dpo_dialogue"


SUMMARY_DATASETS = ("tldr",)  # summarisation prompts, judged with the paper's summarisation prompt


def _source(fn) -> str:
    """A digest of ``fn``'s source code (its name where unreadable): cached scores are asked again after it changes."""
    import inspect

    try:
        return digest([inspect.getsource(fn)])
    except (OSError, TypeError):
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


class Judge:
    """The ``judge=`` scorer, checked before sampling: scores each response or asks each pair both ways; failures uncached."""

    def __init__(self, config: DictConfig, cache: Cache | None = None):
        self.config = config
        self.kind = config.judge.name
        self.cache = cache
        self._built: dict[str, object] = {}
        self.errors: list[str] = []
        assert self.kind in checks.SCORERS  # refused earlier by check_config
        if self.kind == "http_judge":
            for template in {self.template(it) for it in ({"dataset": d} for d in config.datasets)}:
                self._identity(template)  # checks the template now, before any sampling
        elif self.kind == "reward_function":
            self._build()  # imports the functions and checks the weights now, before any sampling
        else:  # a missing folder or a causal LM is refused before any sampling
            problem = checks.reward_model_error(config, f"judge={self.kind}")
            if problem is not None:
                raise ConfigError(problem)
            allow = bool(config.reward_model.allow_untrained_head)
            rewards.check_reward_model_config(config.reward_model.name_or_path, allow)

    def template(self, item: dict):
        """The HTTP judge's template for ``item``: ``judge.template``, or the paper's for its task."""
        if self.config.judge.template is not None:
            return self.config.judge.template
        return SUMMARY_TEMPLATE if item["dataset"] in SUMMARY_DATASETS else DIALOGUE_TEMPLATE

    def _scorer_config(self, template=None) -> DictConfig:
        config = self.config.copy()
        config.online.scorer = self.kind
        config.judge.shuffle_order = False  # both orders are asked
        if self.kind == "http_judge":
            config.judge.template = template
        return config

    def _build(self, template=None):
        name = str(template)
        if name not in self._built:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            self._built[name] = rewards.build_scorer(self._scorer_config(template), device=device)
        return self._built[name]

    def _identity(self, template=None) -> str:
        if self.kind == "http_judge":
            judge = rewards.build_scorer(self._scorer_config(template))  # no request is made
            return digest(["http", judge.url, judge.model, judge.template, judge.max_tokens])
        if self.kind == "reward_function":
            scorer = self._build()
            return digest([self.kind, scorer.names, scorer.weights, [_source(fn) for fn in scorer.functions]])
        path = os.path.expanduser(self.config.reward_model.name_or_path)
        where = sampling._folder_stat(path) if os.path.isdir(path) else path
        return digest([self.kind, where, self.config.reward_model.max_length])

    def judge_all(self, rows: list[dict]) -> None:
        """Set each row's ``verdict`` and ``detail``, asking only what the cache lacks, :data:`JUDGE_CHUNK` at a time."""
        (self._by_scores if self.kind in ("reward_model", "reward_function") else self._pairwise)(rows, JUDGE_CHUNK)

    def _by_scores(self, rows: list[dict], chunk: int) -> None:
        identity = self._identity()
        by_function = self.kind == "reward_function"  # a reward function reads the row's fields; a reward model does not

        def key(row: dict, text: str) -> str:
            fields = row.get("fields") if by_function else None
            return digest([identity, row["judge_prompt"], text, *([fields] if fields else [])])

        wanted = {}
        for row in rows:
            for text in (row["a"], row["b"]):
                k = key(row, text)
                if self.cache.get(k) is None:
                    wanted[k] = (row["judge_prompt"], text, row.get("fields"))
        todo = list(wanted.items())
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            scorer = self._build()
            fields = rewards.field_columns([f for _, (_, _, f) in part]) if by_function else {}
            scores = scorer.score([p for _, (p, _, _) in part], [t for _, (_, t, _) in part], **fields).tolist()
            self.cache.put([{"key": k, "score": s} for (k, _), s in zip(part, scores) if not math.isnan(s)])
            why = getattr(scorer, "last_errors", None)  # a reward function's sentences
            self.errors += list(why) if why else ["NaN score" for s in scores if math.isnan(s)]
        for row in rows:
            a, b = (self.cache.get(key(row, t)) for t in (row["a"], row["b"]))
            sa, sb = (float("nan") if r is None else r["score"] for r in (a, b))
            row["verdict"] = compare_scores(sa, sb)
            row["detail"] = {"score_a": None if a is None else sa, "score_b": None if b is None else sb}

    def _pairwise(self, rows: list[dict], chunk: int) -> None:
        identities = {}
        by_template: dict = {}  # template -> [(key, prompt, first, second)]
        for row in rows:
            template = self.template(row)
            if template not in identities:
                identities[template] = self._identity(template)
            row["_keys"] = []
            for first, second in ((row["a"], row["b"]), (row["b"], row["a"])):
                k = digest([identities[template], row["judge_prompt"], first, second])
                row["_keys"].append(k)
                if row["a"] != row["b"] and self.cache.get(k) is None:
                    by_template.setdefault(template, {})[k] = (k, row["judge_prompt"], first, second)
        for template, requests in by_template.items():
            judge, todo = self._build(template), list(requests.values())
            for start in range(0, len(todo), chunk):
                part = todo[start : start + chunk]
                answers = judge.judge([p for _, p, _, _ in part], [(f, s) for _, _, f, s in part])
                self.cache.put([{"key": k, "answer": a} for (k, _, _, _), a in zip(part, answers) if a is not None])
                self.errors += list(judge.last_errors)
        for row in rows:
            keys = row.pop("_keys")
            if row["a"] == row["b"]:
                row["verdict"], row["detail"] = "tie", {"identical": True}
                continue
            answers = [None if self.cache.get(k) is None else self.cache.get(k)["answer"] for k in keys]
            row["verdict"] = combine_orders(*answers)
            row["detail"] = {"a_first": answers[0], "b_first": answers[1]}
