"""Reward models, reward functions and pairwise judges that label online DPO's pairs (Guo et al. 2024,
arXiv:2402.04792) and evaluate.py's; :func:`build_scorer` picks one from the config."""

from __future__ import annotations

import concurrent.futures
import http.client
import inspect
import json
import math
import numbers
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request

import torch

from evaluation import reward_functions, transport
from modeling import models
from runs.checks import SCORERS
from utils import ConfigError, DataError, get_dtype

TIE = -1  # a pairwise judgement saying neither completion is better

JUDGE_THREADS = 8  # requests HTTPJudge keeps in flight at once

DEFAULT_JUDGE_TEMPLATE = """Two AI assistant responses to the same user prompt follow. Decide which one serves the user better: more helpful, more accurate, and harmless.

### Prompt
{prompt}

### Response 0
{response0}

### Response 1
{response1}

Answer with one character and nothing else: 0 if Response 0 is better, 1 if Response 1 is better."""
"""The built-in pairwise prompt of :class:`HTTPJudge` (placeholders {prompt}, {response0}, {response1})."""

DPO_DIALOGUE_TEMPLATE = """For the following query to a chatbot, which response is more helpful?

Query: {prompt}

Response A:
{response0}

Response B:
{response1}

FIRST provide a one-sentence comparison of the two responses and explain which you feel is more helpful. SECOND, on a new line, state only "A" or "B" to indicate which response is more helpful. Your response should use the format:
Comparison: <one-sentence comparison and explanation>
More helpful: <"A" or "B">"""
"""The DPO paper's dialogue win-rate prompt (Rafailov et al. 2023, appendix C.2); Response A is ``response0``."""

_DPO_SUMMARY = """Which of the following summaries does a better job of summarizing the most important points in the given forum post{extra}

Post:
{{prompt}}

Summary A:
{{response0}}

Summary B:
{{response1}}

FIRST provide a one-sentence comparison of the two summaries, explaining which you prefer and why. SECOND, on a new line, state only "A" or "B" to indicate your choice. Your response should use the format:
Comparison: <one-sentence comparison and explanation>
Preferred: <"A" or "B">"""
DPO_SUMMARIZATION_TEMPLATE = _DPO_SUMMARY.format(extra="?")  # the DPO paper's summarisation win-rate prompt (S), appendix C.2
DPO_SUMMARIZATION_CONCISE_TEMPLATE = _DPO_SUMMARY.format(
    extra=", without including unimportant or irrelevant details? A good summary is both precise and concise."
)
"""The DPO paper's summarisation win-rate prompt (C), "concise" (appendix C.2)."""

JUDGE_TEMPLATES = {
    "dpo_dialogue": (DPO_DIALOGUE_TEMPLATE, r"More helpful:\W*([AB])\b"),
    "dpo_summarization": (DPO_SUMMARIZATION_TEMPLATE, r"Preferred:\W*([AB])\b"),
    "dpo_summarization_concise": (DPO_SUMMARIZATION_CONCISE_TEMPLATE, r"Preferred:\W*([AB])\b"),
}
"""Named ``judge.template`` values: (the prompt, the regex whose last match's group is "A" (``response0`` better) or "B")."""

NAMED_TEMPLATE_MAX_TOKENS = 256  # max_tokens with a named template: a comparison sentence, then the verdict line


# ----------------------------------------------------------------------------- reward models


class RewardModelScorer:
    """Scores ``prompt + completion`` texts with a one-output decoder ``AutoModelForSequenceClassification``
    (its own tokenizer) at each text's last real token, so a text scores the same alone or in any batch;
    the constructor raises ValueError for a head without one output and ConfigError for an untrained one."""

    def __init__(
        self,
        name_or_path: str,
        device="cpu",
        batch_size: int = 16,
        max_length: int = 1024,
        dtype=None,
        allow_untrained_head=False,
    ):
        import transformers

        config = transformers.AutoConfig.from_pretrained(name_or_path, trust_remote_code=False)
        if config.num_labels != 1 and any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
            raise ValueError(f"Reward model {name_or_path} has {config.num_labels} outputs; a reward model needs exactly one.")
        dtype = get_dtype(dtype) if isinstance(dtype, str) else dtype
        model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
            name_or_path, num_labels=1, dtype=dtype, output_loading_info=True, trust_remote_code=False
        )
        random_head = untrained_head(model, info)
        if random_head and not allow_untrained_head:
            raise ConfigError(untrained_head_error(name_or_path, f"{', '.join(random_head)} not in the checkpoint"))
        if random_head:
            print(
                f"[reward_model] warning: {name_or_path}'s score head is random ({', '.join(random_head)} not in the checkpoint)."
            )
        tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
        self._attach(model, tokenizer, device, batch_size, max_length)

    @classmethod
    def from_model(cls, model, tokenizer, device=None, batch_size: int = 16, max_length: int = 1024) -> RewardModelScorer:
        """A scorer over an already loaded ``model`` and ``tokenizer`` (``device`` None: left where it is)."""
        scorer = cls.__new__(cls)
        scorer._attach(model, tokenizer, device, batch_size, max_length)
        return scorer

    def _attach(self, model, tokenizer, device, batch_size: int, max_length: int) -> None:
        if not isinstance(getattr(model, "score", None), torch.nn.Linear):
            raise ValueError(
                f"{type(model).__name__} has no `score` head; RewardModelScorer needs a decoder reward model (Llama, Qwen2, GPT-2, ...)."
            )
        if model.score.out_features != 1:
            raise ValueError(f"The reward model's head has {model.score.out_features} outputs; a reward model needs exactly one.")
        if max_length < 1 or batch_size < 1:
            raise ValueError(f"reward_model.max_length and batch_size must be >= 1, got {max_length} and {batch_size}.")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model = model if device is None else model.to(device)
        self.model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.batch_size = batch_size
        self.max_length = max_length

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text)["input_ids"]
        if len(ids) <= self.max_length:
            return ids
        bos = self.tokenizer.bos_token_id  # too long: keep the end, and the BOS if any
        if bos is not None and ids[0] == bos and self.max_length > 1:
            return [bos] + ids[len(ids) - self.max_length + 1 :]
        return ids[len(ids) - self.max_length :]

    def score(self, prompts: list[str], completions: list[str], **fields) -> torch.Tensor:
        """(N,) float32 CPU rewards of each ``prompts[i] + completions[i]`` in the reward model's units (logits);
        ``fields`` are not used."""
        if len(prompts) != len(completions):
            raise ValueError(f"score() got {len(prompts)} prompts and {len(completions)} completions; pass one of each per text.")
        encoded = [self._encode(p + c) for p, c in zip(prompts, completions)]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths share a batch
        scores = torch.zeros(len(encoded), dtype=torch.float32)
        backbone = getattr(self.model, self.model.base_model_prefix)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model.eval()
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                seqs = [encoded[i] for i in chunk]
                width = max(len(s) for s in seqs)
                ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=self.device)
                mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.device)
                positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as unpadded, also for absolute positions (GPT-2)
                hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)[0]
                # left-padded, so -1 is the last real token (HF's own pooling misses it when pad == eos)
                scores[chunk] = self.model.score(hidden[:, -1]).float().cpu()[:, 0]
        return scores


def untrained_head(model, loading_info: dict) -> list[str]:
    """Names of the head's parameters (those outside ``model.base_model_prefix``) that
    ``from_pretrained(..., output_loading_info=True)`` left random; [] when the head was trained."""
    mismatched = {k if isinstance(k, str) else k[0] for k in loading_info.get("mismatched_keys", [])}
    untouched = set(loading_info.get("missing_keys", [])) | mismatched
    backbone = model.base_model_prefix + "."
    return [n for n, _ in model.named_parameters() if not n.startswith(backbone) and n in untouched]


def untrained_head_error(name_or_path: str, why: str) -> str:
    """The sentence that refuses a reward model whose score head was never trained; ``why`` says how it was seen."""
    return (
        f"reward_model.name_or_path={name_or_path} has no trained score head ({why}), so its scores would be random: "
        "give a reward model (e.g. the LATEST/hf of a loss=reward run), or set reward_model.allow_untrained_head=true "
        "to use it anyway."
    )


def check_reward_model_config(name_or_path: str, allow_untrained_head: bool = False) -> None:
    """Raise ConfigError for a local reward model folder whose config.json names no
    ``*ForSequenceClassification`` architecture, before any weight is read (hub ids are checked on load)."""
    import transformers

    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        problem = models.custom_code_problem(path, "reward_model.name_or_path")
        if problem is not None:
            raise ConfigError(problem)
    if allow_untrained_head or not os.path.isfile(os.path.join(path, "config.json")):
        return
    architectures = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False).architectures or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(untrained_head_error(name_or_path, f"its config.json names {architectures[0]}"))


def apply_missing_eos_penalty(
    scores: torch.Tensor,
    completion_ids: torch.Tensor,
    eos_token_id: int | list[int],
    penalty: float | None,
    completion_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N,) ``scores`` minus ``penalty`` (reward units; None or 0: unchanged) for each (N, T) completion with
    no ``eos_token_id`` among its real tokens (``completion_mask``, needed when pad == eos); TRL's ``missing_eos_penalty``."""
    if not penalty:
        return scores
    if completion_ids.dim() != 2 or scores.shape != completion_ids.shape[:1]:
        raise ValueError(
            f"scores must be (N,) and completion_ids (N, T), got {tuple(scores.shape)} and {tuple(completion_ids.shape)}."
        )
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_token_id, device=completion_ids.device))
    if completion_mask is not None:
        if completion_mask.shape != completion_ids.shape:
            raise ValueError(
                f"completion_mask {tuple(completion_mask.shape)} must have completion_ids' shape {tuple(completion_ids.shape)}."
            )
        is_eos &= completion_mask.bool()
    missing = ~is_eos.any(dim=-1)
    return scores - penalty * missing.to(scores.dtype)


def field_columns(fields: list[dict | None]) -> dict[str, list]:
    """``score``'s ``**fields`` from one dict per text: a list per column (None where a text lacks it); raises
    DataError for a column named ``prompts`` or ``completions``."""
    columns = list(dict.fromkeys(c for f in fields if f for c in f))
    for column in columns:
        if column in ("prompts", "completions"):
            raise DataError(
                f"The data has a column named {column!r}, which reward functions would receive as their own {column} "
                f"argument; rename that column in the data file (e.g. to {column}_field)."
            )
    return {c: [(f or {}).get(c) for f in fields] for c in columns}


def _shown(text: str, limit: int = 60) -> str:
    """``text`` as a short repr for an error sentence: its first ``limit`` characters, then "..."."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


class RewardFunctionScorer:
    """The weighted sum of Python reward functions' scores per completion (a None skipped, as TRL's
    ``reward_weights``); a completion fails (NaN, its sentence in ``last_errors``, counted in ``failures``) when every
    function returns None for it or one raises on it or returns a non-number."""

    def __init__(self, names: list[str], functions: list, weights: list[float]):
        if not len(names) == len(functions) == len(weights):
            raise ValueError(
                f"{len(names)} names, {len(functions)} functions and {len(weights)} weights; give one of each per function."
            )
        self.names, self.functions, self.weights = list(names), list(functions), [float(w) for w in weights]
        self.last_errors: list[str] = []
        self.failures = 0
        self._fields_taken = [self._takes(fn) for fn in self.functions]

    @classmethod
    def from_config(cls, config) -> RewardFunctionScorer:
        """The scorer over ``config.reward_functions`` and ``config.reward_weights``; raises ConfigError."""
        specs = config.get("reward_functions")
        specs = list(specs) if specs is not None and not isinstance(specs, str) else specs
        weights = config.get("reward_weights")
        return cls(*reward_functions.resolve_all(specs, weights))

    @staticmethod
    def _takes(fn):
        """None when ``fn`` takes every field (``**kwargs``, or no signature to read), else the names it takes."""
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return None
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return None
        return {p.name for p in parameters}

    def score(self, prompts: list[str], completions: list[str], **fields) -> torch.Tensor:
        """(N,) float32 CPU weighted rewards of each ``completions[i]`` answering ``prompts[i]`` (``fields``: the
        rows' other columns, lists of length N); NaN where it failed."""
        n = len(prompts)
        if len(completions) != n or any(len(v) != n for v in fields.values()):
            raise ValueError(
                f"score() got {n} prompts, {len(completions)} completions and fields of other lengths; pass one of each per text."
            )
        self.last_errors = []
        totals = [0.0] * n
        scored = [False] * n
        failed: dict[int, str] = {}  # row -> why
        for name, fn, weight, takes in zip(self.names, self.functions, self.weights, self._fields_taken):
            passed = {k: list(v) for k, v in fields.items() if takes is None or k in takes}
            for i, value in enumerate(self._call(name, fn, list(prompts), list(completions), passed, failed)):
                if value is not None and i not in failed:
                    totals[i] += weight * value
                    scored[i] = True
        for i in range(n):
            if i not in failed and not scored[i]:
                failed[i] = (
                    f"every reward function ({', '.join(self.names)}) returned None for the completion of prompt {_shown(prompts[i])}"
                )
        scores = torch.tensor(totals, dtype=torch.float32)
        for i in sorted(failed):
            scores[i] = float("nan")
            self.last_errors.append(failed[i])
        self.failures += len(failed)
        return scores

    def _call(self, name: str, fn, prompts: list[str], completions: list[str], fields: dict, failed: dict) -> list[float | None]:
        """``fn``'s scores of the rows as floats or None (NaN read as None); rows it raised on or
        gave a non-number are added to ``failed`` with the sentence that says so."""
        n = len(prompts)
        try:
            values = fn(prompts, completions, **fields)
        except Exception:  # asked again row by row: which rows raise
            values = []
            for i in range(n):
                try:
                    row = fn(prompts[i : i + 1], completions[i : i + 1], **{k: v[i : i + 1] for k, v in fields.items()})
                except Exception as e:
                    failed.setdefault(
                        i,
                        f"reward function {name} raised {type(e).__name__}: {e} on the completion of prompt {_shown(prompts[i])}",
                    )
                    values.append(None)
                    continue
                values.append(row[0] if isinstance(row, (list, tuple)) and len(row) == 1 else row)
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} scores" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            for i in range(n):
                failed.setdefault(
                    i,
                    f"reward function {name} returned {got} for {n} completions; it must return a list of one number (or None) per completion",
                )
            return [None] * n
        out: list[float | None] = []
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if v is None or (isinstance(v, numbers.Real) and math.isnan(v)):
                out.append(None)
            elif isinstance(v, numbers.Real):
                out.append(float(v))
            else:
                failed.setdefault(
                    i,
                    f"reward function {name} returned {repr(v)[:40]} (a {type(v).__name__}) for the completion of prompt "
                    f"{_shown(prompts[i])}; it must return a number or None",
                )
                out.append(None)
        return out


# ----------------------------------------------------------------------------- judges


class PairwiseJudge:
    """Says which of two completions of a prompt is better; ``failures`` counts failed judgements, ``last_errors`` says why."""

    def __init__(self):
        self.failures = 0
        self.last_errors: list[str] = []

    def judge(self, prompts: list[str], pairs: list[tuple[str, str]]) -> list[int | None]:
        """One judgement per (prompt, pair): 0 if ``pair[0]`` is better, 1 if ``pair[1]`` is,
        :data:`TIE` if neither, None if the judgement failed (counted in ``failures``)."""
        raise NotImplementedError

    def _fail(self, why: str) -> None:
        self.failures += 1
        self.last_errors.append(why)

    def state_dict(self) -> dict:
        """What a resumed run needs to judge on as this judge would have, in plain types (``failures``)."""
        return {"failures": self.failures}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.failures = int(state["failures"])


class RewardModelJudge(PairwiseJudge):
    """A pairwise judge over a scorer: the higher score wins, equal scores are a :data:`TIE`, a NaN fails;
    ``last_scores``: (N, 2) float32, the last call's scores."""

    def __init__(self, scorer):
        super().__init__()
        self.scorer = scorer
        self.last_scores = torch.empty(0, 2)

    def judge(self, prompts: list[str], pairs: list[tuple[str, str]]) -> list[int | None]:
        """See :meth:`PairwiseJudge.judge`. Both completions of every pair are scored in one call."""
        if len(prompts) != len(pairs):
            raise ValueError(f"judge() got {len(prompts)} prompts and {len(pairs)} pairs; pass one pair per prompt.")
        self.last_errors = []
        scores = self.scorer.score([p for p in prompts for _ in range(2)], [c for pair in pairs for c in pair])
        self.last_scores = scores.reshape(-1, 2)
        results: list[int | None] = []
        for a, b in self.last_scores.tolist():
            if a != a or b != b:  # NaN
                self._fail(f"NaN score ({a}, {b})")
                results.append(None)
            else:
                results.append(0 if a > b else 1 if b > a else TIE)
        return results


class HTTPJudge(PairwiseJudge):
    """An LLM judge behind an OpenAI-compatible ``{base_url}/chat/completions`` (TRL's ``OpenAIPairwiseJudge``): one
    temperature-0 request per pair (seeded random order with ``shuffle_order``, key from ``$api_key_env``) answered "0" or
    "1" (or a :data:`JUDGE_TEMPLATES` verdict line), 429, 5xx and connection errors retried ``max_retries`` times after
    ``backoff * 2**k`` s, a failure None, never raised (the constructor raises ConfigError for bad settings)."""

    def __init__(
        self,
        base_url,
        model,
        template=None,
        timeout=30.0,
        max_retries=3,
        api_key_env="OPENAI_API_KEY",
        shuffle_order=True,
        seed=0,
        backoff=0.5,
    ):
        super().__init__()
        assert base_url and str(base_url).startswith(("http://", "https://")) and model  # refused earlier by checks.scorer_error
        self.template = DEFAULT_JUDGE_TEMPLATE if template is None else template
        self.answer_pattern, self.max_tokens = None, 1  # the answer's first character: "0" or "1"
        if template in JUDGE_TEMPLATES:
            self.template, pattern = JUDGE_TEMPLATES[template]
            self.answer_pattern, self.max_tokens = re.compile(pattern), NAMED_TEMPLATE_MAX_TOKENS
        try:
            self.template.format(prompt="", response0="", response1="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"judge.template must use only the placeholders {{prompt}}, {{response0}}, {{response1}} ({type(e).__name__}: {e})."
            ) from None
        for name in ("prompt", "response0", "response1"):
            if "{" + name + "}" not in self.template:
                raise ConfigError(
                    f"judge.template has no {{{name}}} placeholder; it needs {{prompt}}, {{response0}} and {{response1}}."
                )
        if int(max_retries) < 0 or not float(timeout) > 0:
            raise ConfigError(f"judge.max_retries must be >= 0 and judge.timeout > 0, got {max_retries} and {timeout}.")
        self.url = str(base_url).rstrip("/") + "/chat/completions"
        self.model = model
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.shuffle_order = shuffle_order
        self.rng = random.Random(seed)
        key = os.environ.get(api_key_env) if api_key_env else None
        self._headers = {"Content-Type": "application/json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        self._lock = threading.Lock()

    def judge(self, prompts: list[str], pairs: list[tuple[str, str]]) -> list[int | None]:
        """See :meth:`PairwiseJudge.judge`; a failed judgement never raises (ValueError for lists of different lengths)."""
        if len(prompts) != len(pairs):
            raise ValueError(f"judge() got {len(prompts)} prompts and {len(pairs)} pairs; pass one pair per prompt.")
        self.last_errors = []
        swaps = [self.shuffle_order and self.rng.random() < 0.5 for _ in pairs]  # drawn here: reproducible order
        jobs = [(p, (b, a) if s else (a, b)) for p, (a, b), s in zip(prompts, pairs, swaps)]
        if not jobs:
            return []
        with concurrent.futures.ThreadPoolExecutor(min(JUDGE_THREADS, len(jobs))) as pool:
            answers = list(pool.map(lambda job: self._ask(*job), jobs))
        return [None if a is None else 1 - a if s else a for a, s in zip(answers, swaps)]

    def _fail(self, why: str) -> None:
        with self._lock:
            super()._fail(why)

    def state_dict(self) -> dict:
        """``failures`` and ``rng``, the order-shuffling RNG's ``getstate()`` (a tuple of ints)."""
        return {**super().state_dict(), "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (the RNG's state may come back with lists for tuples)."""
        super().load_state_dict(state)
        version, internal, gauss_next = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss_next))

    def _ask(self, prompt: str, pair: tuple[str, str]) -> int | None:
        content = self.template.format(prompt=prompt, response0=pair[0], response1=pair[1])
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        data = json.dumps(body).encode("utf-8")
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                raw = transport.post(self.url, data, self._headers, self.timeout)
            except urllib.error.HTTPError as e:
                e.close()
                why = f"HTTP {e.code} from {self.url}"
                if 300 <= e.code < 400:
                    why += f", a redirect to {e.headers.get('Location')} that is not followed (give judge.base_url the address it names if you trust it)"
                if e.code != 429 and e.code < 500:
                    break
                continue
            except transport.ResponseTooLargeError as e:  # not retried: the same server would send it again
                why = str(e)
                break
            except (OSError, http.client.HTTPException) as e:  # connection refused or reset, timeouts
                why = f"{type(e).__name__} from {self.url}: {e}"
                continue
            return self._parse(raw)
        self._fail(f"{why} (after {attempt + 1} attempts)")
        return None

    def _parse(self, raw: bytes) -> int | None:
        try:
            answer = json.loads(raw)["choices"][0]["message"]["content"].lstrip()
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            self._fail(f"malformed chat-completions response ({type(e).__name__}): {raw[:200]!r}")
            return None
        if self.answer_pattern is not None:
            found = self.answer_pattern.findall(answer)
            if found:
                return "AB".index(found[-1])
            self._fail(f"the judge's answer {answer[-80:]!r} has no verdict line matching {self.answer_pattern.pattern!r}")
            return None
        if answer[:1] in ("0", "1"):
            return int(answer[0])
        self._fail(f"the judge answered {answer[:50]!r}, not 0 or 1")
        return None


# ----------------------------------------------------------------------------- from the config


def build_scorer(config, device=None):
    """The scorer or judge ``online.scorer`` names (:data:`SCORERS`) from the Hydra config, a reward model on
    ``device`` (None: cuda when available), its settings checked first by :func:`checks.scorer_error`."""
    kind = config.online.scorer
    assert kind in SCORERS  # refused earlier by checks.scorer_error
    if kind == "reward_function":
        return RewardFunctionScorer.from_config(config)
    if kind == "http_judge":
        judge = config.judge
        return HTTPJudge(
            judge.base_url,
            judge.model,
            template=judge.template,
            timeout=judge.timeout,
            max_retries=judge.max_retries,
            api_key_env=judge.api_key_env,
            shuffle_order=judge.shuffle_order,
            seed=config.get("seed", 0),
        )
    rm = config.reward_model
    path = rm.name_or_path
    assert path is not None  # refused earlier by checks.scorer_error
    allow = bool(rm.get("allow_untrained_head", False))
    check_reward_model_config(path, allow)  # before the weights load
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    scorer = RewardModelScorer(
        os.path.expanduser(path),
        device=device,
        batch_size=rm.batch_size,
        max_length=rm.max_length,
        dtype=rm.get("dtype"),
        allow_untrained_head=allow,
    )
    return RewardModelJudge(scorer) if kind == "reward_model_judge" else scorer
