"""lm-evaluation-harness's model interface on a fastllm `GPTModel`, computed as its `hf` backend
computes it (the same tokenization, truncation, rolling windows, stop sequences and greedy
decoding), so that a task's results agree with that backend's on the same weights.

What differs is how: requests of one context (a question's answers) share one row, the context
read once and each continuation a branch attending to it, rows are sorted by length and
batched, only the scored positions go through the head (no batch of logits), and a batch of
prompts is generated at once, left-padded, through the KV cache. Under torchrun each
data-parallel rank scores the documents lm-eval gives it, and lm-eval gathers the metrics
through this class's collectives; a model being trained with ZeRO-3 has its stages gathered
as the passes run (`sharded_weights`), a tensor-parallel one scores through the vocabulary
slices of its head (`scoring`) and generates on its gathered logits, and one split along the
sequence over its tensor ranks or into stages over pipeline ranks runs its passes as
`passes` says."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    configure_pad_token,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.models.utils_hf import stop_sequences_criteria
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import Tensor

from fastllm.evaluation.passes import LayoutPasses
from fastllm.evaluation.scoring import token_log_probs
from fastllm.evaluation.sharded_weights import Pass, ShardedPasses
from fastllm.hf import FastLLMForCausalLM
from fastllm.model import GPTModel
from fastllm.parallel.dimension import Dimension
from fastllm_kernels.attention import dense_masks

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance
    from transformers import PreTrainedTokenizerBase

    from fastllm.engine.model_stages import ModelStages

Scored = tuple[tuple[str, str] | None, list[int], list[int]]
"""lm-eval's tokenized loglikelihood request: (strings, context tokens, continuation tokens)."""


class FastLLMLM(TemplateLM):
    """lm-eval's `LM` on `model` (whole on this process, or this rank's part of a model split
    over tensor ranks, and over pipeline ranks when `stages` says so), tokenizing with
    `tokenizer` (the model directory's, as `AutoTokenizer` loads it).

    `max_length`: the context length (lm-eval's hf backend takes `max_position_embeddings`
    from config.json, else 2048); `batch_size`: rows per forward pass; `eos_token_ids`: the
    tokens that end a generation (the generation config's; default the tokenizer's
    end-of-sequence). `data`: the ranks that split the documents (the mesh's document groups:
    its data ranks but those of one sequence-data or expert group, which answer the same
    documents as tensor and pipeline ranks do; default: all ranks when torch.distributed is
    initialized). `stages`: the flat buffers that hold the model's weights (a model being
    trained), whose stages the passes run on their pipeline ranks, gathering their ZeRO-3
    shards."""

    def __init__(
        self,
        model: GPTModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_length: int,
        batch_size: int = 16,
        max_gen_toks: int = 256,
        eos_token_ids: Sequence[int] | None = None,
        data: Dimension | None = None,
        stages: ModelStages | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = configure_pad_token(tokenizer)
        self._max_length, self._batch_size, self._max_gen_toks = (
            max_length,
            batch_size,
            max_gen_toks,
        )
        self._passes = LayoutPasses(model, stages)
        self._device = self._passes.device
        self.group: dist.ProcessGroup | None = None  # None: every rank
        if data is not None:
            self.group, self._rank, self._world_size = data.group, data.rank, data.size
        elif dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        eos = [self.eot_token_id] if eos_token_ids is None else list(eos_token_ids)
        self._eos_token_ids = eos
        self._generator: FastLLMForCausalLM | None = None
        self._sharded = (
            ShardedPasses(stages, stages.mesh.data.group)
            if stages is not None and stages.weights_sharded
            else None
        )

    # The sizes and tokens lm-eval reads.
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token a context-less request is scored after: BOS, else EOS (as the hf backend)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """The tokenizer's own special tokens (BOS where it adds one), unless the string starts
        with BOS already or `add_special_tokens` says otherwise."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            options["add_special_tokens"] = False
        return self.tokenizer.encode(string, **options)

    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """`TemplateLM.loglikelihood`'s requests and tokens, each distinct string encoded once
        and all of them in batch calls of the tokenizer (its threads), rather than two calls a
        request: with 8,000 requests, those calls took more time than scoring them."""
        pairs = [request.args for request in requests]
        split = [
            _move_trailing_space(context, continuation) if context else None
            for context, continuation in pairs
        ]
        wanted = [(continuation, False) for (context, continuation) in pairs if not context]
        for context, continuation in filter(None, split):
            wanted += [(context + continuation, None), (context, None)]
        encoded = self._encode_all(wanted)
        scored: list[Scored] = []
        for strings, moved in zip(pairs, split, strict=True):
            if moved is None:  # no context: scored after BOS (else EOS), as TemplateLM does
                tokens = encoded[strings[1], False]
                if tokens and tokens[0] == self.prefix_token_id:
                    scored.append((strings, tokens[:1], tokens[1:]))
                else:
                    scored.append((strings, [self.prefix_token_id], tokens))
                continue
            context, continuation = moved
            whole, context_tokens = encoded[context + continuation, None], encoded[context, None]
            scored.append((strings, context_tokens, whole[len(context_tokens) :]))
        return self._loglikelihood_tokens(scored, disable_tqdm=disable_tqdm)

    def _encode_all(
        self, wanted: list[tuple[str, bool | None]]
    ) -> dict[tuple[str, bool | None], list[int]]:
        """`tok_encode(string, add_special_tokens)` of each, by (string, add_special_tokens)."""
        prefix = self.tokenizer.decode(self.prefix_token_id)
        by_option: dict[bool | None, list[tuple[str, bool | None]]] = defaultdict(list)
        for key in dict.fromkeys(wanted):
            string, option = key
            if option is None and has_bos_prefix(string, prefix):
                option = False  # as tok_encode: the string brings its own BOS
            by_option[option].append(key)
        encoded = {}
        for option, keys in by_option.items():
            options = {} if option is None else {"add_special_tokens": option}
            ids = self.tokenizer([string for string, _ in keys], **options)["input_ids"]
            encoded.update(zip(keys, ids, strict=True))
        return encoded

    def tok_decode(self, tokens: int | list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # Collectives over the data-parallel ranks, which lm-eval's `evaluate` calls.
    def all_gather(self, tensor: Tensor) -> Tensor:
        if self.world_size == 1:
            return tensor
        self._take_turn()
        pieces = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.group)
        return torch.stack(pieces) if tensor.dim() == 0 else torch.cat(pieces)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        self._take_turn()
        gathered = [None] * self.world_size if self.rank == dst else None
        root = dst if self.group is None else dist.get_global_rank(self.group, dst)
        dist.gather_object(obj, gathered, dst=root, group=self.group)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            self._take_turn()
            dist.barrier(group=self.group)

    def _take_turn(self) -> None:
        """Before a collective of lm-eval's: the other ranks' passes that ZeRO-3 gathers for."""
        if self._sharded is not None:
            self._sharded.take_turn(Pass.NONE)

    def _pass(self, kind: Pass) -> contextlib.AbstractContextManager[None]:
        """A forward pass of `kind` (or a generation's many): under ZeRO-3, with the other
        ranks' gathers."""
        return contextlib.nullcontext() if self._sharded is None else self._sharded.running(kind)

    # Scoring.
    def _loglikelihood_tokens(
        self, requests: list[Scored], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) of
        each request. The model reads (context + continuation)[:-1], cut from the left to
        `max_length` tokens; the last len(continuation) positions are scored.

        Requests of one context (a multiple-choice question's answers) share a row: the
        context once, then each continuation but its last token as a branch that attends to
        the context and to itself only, its positions following the context's; the context's
        last position scores every continuation's first token."""
        pieces: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        of_request = []  # each request's (context, continuation) piece
        for _, context, continuation in requests:
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError(
                    f"bad loglikelihood request: {len(context)} context and "
                    f"{len(continuation)} continuation tokens (max_length {self.max_length})"
                )
            window = (context + continuation)[-(self.max_length + 1) :]
            piece = (tuple(window[: -len(continuation)]), tuple(continuation))
            of_request.append(pieces.setdefault(piece, len(pieces)))
        rows = self._shared_rows(list(pieces))
        rows.sort(key=lambda row: (-row.length, row.context))
        scores: list[tuple[float, bool]] = [(0.0, False)] * len(pieces)
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            with self._pass(Pass.SCORE):
                log_probs, greedy, lengths = self._score(batch)
            # Each piece's sum and whether all its tokens are greedy, read in one transfer.
            of_piece = torch.repeat_interleave(
                torch.arange(len(lengths), device=self.device),
                torch.tensor(lengths, device=self.device),
            )
            sums = torch.zeros(len(lengths), dtype=torch.float64, device=self.device)
            sums.index_add_(0, of_piece, log_probs.double())
            missed = torch.zeros(len(lengths), dtype=torch.long, device=self.device)
            missed.index_add_(0, of_piece, (~greedy).long())
            pieces_here = [piece for row in batch for piece in row.pieces]
            for piece, total, misses in zip(
                pieces_here, sums.tolist(), missed.tolist(), strict=True
            ):
                scores[piece] = (total, misses == 0)
        results = [scores[piece] for piece in of_request]
        for (strings, _, _), result in zip(requests, results, strict=True):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def _score(self, batch: list[_Row]) -> tuple[Tensor, Tensor, list[int]]:
        """The log-probability of each scored token of `batch`, whether it is the greedy
        one, and how many tokens each piece has (in the rows' order), on every rank (computed
        on the last pipeline stage's)."""
        hidden = self._hidden_states(batch)
        batch_index, position, target, lengths = [], [], [], []
        for b, row in enumerate(batch):
            for offset, continuation in zip(row.offsets, row.continuations, strict=True):
                # The context's last position, then the branch's own.
                batch_index += [b] * len(continuation)
                position += [
                    len(row.context) - 1,
                    *range(offset, offset + len(continuation) - 1),
                ]
                target += continuation
                lengths.append(len(continuation))
        scores = None
        if hidden is not None:
            index = torch.tensor([batch_index, position], device=self.device)
            log_probs, greedy = token_log_probs(
                hidden[index[0], index[1]],
                self.model.head_weight,
                torch.tensor(target, device=self.device),
                self.model.tensor,
            )
            scores = torch.stack([log_probs, greedy.float()])
        scores = self._passes.from_last_stage(scores, (2, len(target)))
        return scores[0], scores[1].bool(), lengths

    def _shared_rows(self, pieces: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[_Row]:
        """The rows that read `pieces` (context, continuation): the continuations of one
        context together, as many as fit `max_length` a row (one a row where the model's
        sliding windows count rows, not positions)."""
        share = not any(
            self.model.config.transformer.window_of(i) is not None
            for i in range(self.model.config.transformer.num_layers)
        )
        by_context: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for index, (context, _) in enumerate(pieces):
            by_context[context].append(index)
        rows = []
        for context, indices in by_context.items():
            row = _Row(context)
            for index in indices:
                continuation = pieces[index][1]
                if row.pieces and (
                    not share or row.length + row.grown_by(continuation) > self.max_length
                ):
                    rows.append(row)
                    row = _Row(context)
                row.add(index, continuation)
            rows.append(row)
        return rows

    @contextlib.contextmanager
    def _in_eval_mode(self) -> Iterator[None]:
        """The model without dropout while it answers, then in the mode it was in (a model
        being trained goes back to training)."""
        training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(training)

    def _hidden_states(self, rows: list[_Row]) -> Tensor | None:
        """Final-normed hidden states of `rows`, right-padded to the longest (to a length the
        tensor ranks divide, under sequence-tensor parallelism): a padded position comes after
        every real one, which causal attention never lets it reach; on the rank of the last
        pipeline stage (None on the others). Branches (rows of several continuations) are read
        with their branch ids and positions, as a dense mask (the batches' shapes vary:
        flex_attention would compile each)."""
        length = self._passes.padded(rows[0].length)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        branches = any(len(row.branches) > 1 for row in rows)
        branch_ids = torch.zeros(len(rows), length, dtype=torch.int32) if branches else None
        positions = torch.zeros(len(rows), length, dtype=torch.long) if branches else None
        for b, row in enumerate(rows):
            ids[b, : row.length] = torch.tensor(row.tokens)
            if branch_ids is not None and positions is not None:
                branch_ids[b, : row.length] = torch.tensor(row.branch_ids)
                positions[b, : row.length] = torch.tensor(row.positions)
        options: dict[str, Tensor] = {}
        if branch_ids is not None and positions is not None:
            options = {
                "branch_ids": branch_ids.to(self.device, non_blocking=True),
                "position_ids": positions.to(self.device, non_blocking=True),
            }
        ids = ids.to(self.device, non_blocking=True)
        with torch.no_grad(), self._in_eval_mode(), dense_masks():
            return self._passes.hidden_states(ids, **options)

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """The log-likelihood of each whole text, over disjoint windows of `max_length` tokens
        that each see the previous window's last token (the first one sees the prefix token)."""
        windows: list[Scored] = []
        counts = []
        for (text,) in (request.args for request in requests):
            pieces = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows += [(None, context, continuation) for context, continuation in pieces]
            counts.append(len(pieces))
        scores = iter(self._loglikelihood_tokens(windows))
        totals = []
        for request, count in zip(requests, counts, strict=True):
            totals.append(sum(next(scores)[0] for _ in range(count)))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
        return totals

    # Generation.
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each prompt's continuation, up to the first stop sequence (`until`, and the
        end-of-sequence token) or `max_gen_toks` tokens. Prompts of the same generation
        settings are generated together, longest first, `batch_size` at a time."""
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        collator = Collator(
            [request.args for request in requests],
            sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
            group_by="gen_kwargs",
            group_fn=lambda args: args[1],
        )
        texts = []
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, settings = zip(*chunk, strict=True)
            options = dict(normalize_gen_kwargs(settings[0], self.max_gen_toks))
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_gen_toks = options.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise ValueError(
                    f"max_gen_toks {max_gen_toks} leaves no room for a prompt in "
                    f"{self.max_length} tokens"
                )
            ids, mask = self._left_padded(list(contexts), self.max_length - max_gen_toks)
            output = self._generate(ids, mask, until, max_gen_toks, options)
            for context, tokens in zip(contexts, output[:, ids.shape[1] :].tolist(), strict=True):
                text = postprocess_generated_text(self.tok_decode(tokens), until, None)
                texts.append(text)
                self.cache_hook.add_partial("generate_until", (context, settings[0]), text)
        return collator.get_original(texts)

    def _left_padded(self, texts: list[str], max_tokens: int) -> tuple[Tensor, Tensor]:
        """The prompts' tokens, left-padded to the longest and cut from the left to
        `max_tokens`, and their attention mask (0 on the padding)."""
        options = {}
        if has_bos_prefix(texts[0], getattr(self.tokenizer, "bos_token", None)):
            options["add_special_tokens"] = False
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        try:
            encoding = self.tokenizer(texts, padding="longest", return_tensors="pt", **options)
        finally:
            self.tokenizer.padding_side = side
        ids, mask = (
            encoding["input_ids"][:, -max_tokens:],
            encoding["attention_mask"][:, -max_tokens:],
        )
        return ids.to(self.device), mask.to(self.device)

    def _generate(
        self, ids: Tensor, mask: Tensor, until: list[str], max_gen_toks: int, options: dict
    ) -> Tensor:
        """`generate()` of the `transformers` wrapper, with the hf backend's settings: greedy
        unless sampling was asked for, each stop sequence a stopping criterion. Through the
        key/value cache, but under sequence-data parallelism, whose attention splits every
        pass's rows over its ranks (a step of one token a row has nothing to split): there
        each step reads the whole sequence again."""
        if not options.get("do_sample") and options.get("temperature", 0.0) == 0.0:
            options = {**options, "do_sample": False}
            options.pop("temperature", None)
        with self._in_eval_mode():  # wrap() sets eval mode too
            if self._generator is None:
                self._generator = FastLLMForCausalLM.wrap(self.model, self._passes.logits)
        stopping = stop_sequences_criteria(self.tokenizer, until, ids.shape[1], ids.shape[0])
        # Each batch's prompts are padded to another length: dense masks, not a flex_attention
        # compiled for each. Under ZeRO-3 the whole call runs on weights gathered once.
        with torch.no_grad(), self._in_eval_mode(), dense_masks(), self._pass(Pass.GENERATE):
            return self._generator.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_gen_toks,
                stopping_criteria=stopping,
                eos_token_id=self._eos_token_ids,
                pad_token_id=self.tokenizer.pad_token_id,
                use_cache=not self.model.sequence_data.split,
                **options,
            )


class _Row:
    """One row of loglikelihood scoring: a context, then the continuations as branches, each
    without its last token (which nothing reads); continuations that differ only in their last
    token read one branch."""

    def __init__(self, context: tuple[int, ...]) -> None:
        self.context = context
        self.pieces: list[int] = []
        self.continuations: list[tuple[int, ...]] = []
        self.offsets: list[int] = []
        """Where each piece's branch starts in the row."""
        self.branches: dict[tuple[int, ...], int] = {}
        """Each branch's tokens and where it starts."""
        self.length = len(context)

    def grown_by(self, continuation: tuple[int, ...]) -> int:
        """The tokens `add(…, continuation)` would add."""
        return 0 if continuation[:-1] in self.branches else len(continuation) - 1

    def add(self, piece: int, continuation: tuple[int, ...]) -> None:
        branch = continuation[:-1]
        if branch not in self.branches:
            self.branches[branch] = self.length
            self.length += len(branch)
        self.pieces.append(piece)
        self.continuations.append(continuation)
        self.offsets.append(self.branches[branch])

    @property
    def tokens(self) -> list[int]:
        return [*self.context, *(t for branch in self.branches for t in branch)]

    @property
    def branch_ids(self) -> list[int]:
        """0 for the context, which every branch reads; 1, 2, … for the branches."""
        ids = [0] * len(self.context)
        for number, branch in enumerate(self.branches, start=1):
            ids += [number] * len(branch)
        return ids

    @property
    def positions(self) -> list[int]:
        """Each branch's positions follow the context's, as if it were the only one."""
        start = len(self.context)
        return [*range(start), *(p for b in self.branches for p in range(start, start + len(b)))]


def _move_trailing_space(context: str, continuation: str) -> tuple[str, str]:
    """The context's trailing whitespace moved to the continuation, as `TemplateLM._encode_pair`
    does (a word's tokens keep their leading space)."""
    stripped = context.rstrip()
    return stripped, context[len(stripped) :] + continuation
