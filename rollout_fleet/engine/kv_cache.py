"""The running batch's KV cache: right-aligned rows sharing one write index.

Layout: per layer, key and value buffers ``[rows, kv_heads, capacity, head_dim]``.
All rows share the write index ``length``; a row that joined with a shorter
history is left-padded with zeros, and ``mask [rows, capacity]`` marks which
columns hold that row's real tokens. Each row also keeps its own next position
id (its count of real tokens), so rotary embeddings see unpadded positions.
This works with any Hugging Face causal LM whose attention takes a 2-D padding
mask plus a ``Cache`` (Qwen2, Llama, Mistral, ...), and gives the same numbers
as decoding each sequence alone (padding columns get zero attention weight).

``rebuild`` is the single reshaping operation: it keeps a chosen subset of rows,
appends freshly prefilled rows (whose KV is all real tokens), drops leading
columns no remaining row uses, and reserves room to grow (reserved columns are
left uninitialised: they are written before anything reads them). It runs only when rows
join or leave, never per decode step. ``hf_cache()`` wraps the buffers in a
transformers ``Cache`` whose layers write the new token in place at ``length``.

``PrefillCache`` is the prefix sharing (SGLang's radix-cache pattern, exact
matches only): the last-position logits and KV of recently prefilled token
sequences, so the n samples of a GRPO group, sent as n requests that may be
admitted in different steps, run their shared prompt through the model once.
Each sample then gets its own copy of the rows in the batch cache and decodes
independently.

Left out: paging / block tables, partial-prefix matches (a prompt that extends a
cached one is prefilled in full), sliding-window layers.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from transformers.cache_utils import Cache, DynamicLayer

# Columns reserved beyond the current length whenever buffers are (re)allocated.
GROWTH_COLUMNS = 64


class _InPlaceLayer(DynamicLayer):
    """A cache layer over preallocated buffers: ``update`` writes at the current length."""

    def __init__(self, key_buf: torch.Tensor, value_buf: torch.Tensor, length: int) -> None:
        super().__init__()
        self.key_buf = key_buf
        self.value_buf = value_buf
        self.device = key_buf.device
        self.keys = key_buf[:, :, :length]
        self.values = value_buf[:, :, :length]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        self.key_buf[:, :, start:end] = key_states
        self.value_buf[:, :, start:end] = value_states
        self.keys = self.key_buf[:, :, :end]
        self.values = self.value_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


class BatchKVCache:
    """KV buffers, padding mask and position ids for the rows of the running batch."""

    def __init__(self, num_layers: int, device: torch.device, dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.device = device
        self.dtype = dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(0, dtype=torch.long, device=device)
        self.length = 0

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.mask.shape[1])

    def rebuild(
        self,
        keep_rows: list[int],
        new_kv: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
        reserve: int = GROWTH_COLUMNS,
    ) -> None:
        """Keep ``keep_rows`` (in that order), then append each entry of ``new_kv``.

        ``new_kv`` entries are ``(keys_per_layer, values_per_layer)`` with tensors
        ``[k, kv_heads, P, head_dim]`` holding only real tokens. The result has at
        least ``reserve`` free columns.
        """
        keep = torch.tensor(keep_rows, dtype=torch.long, device=self.device)
        old_mask = self.mask[keep, : self.length] if keep_rows else self.mask[:0, : self.length]
        # Leading columns that no kept row uses are dropped.
        used = old_mask.any(dim=0).nonzero()
        first_used = int(used[0]) if used.numel() else self.length
        kept_len = self.length - first_used
        new_lens = [kv[0][0].shape[2] for kv in new_kv]
        new_counts = [kv[0][0].shape[0] for kv in new_kv]
        length = max([kept_len, *new_lens]) if (new_kv or keep_rows) else 0
        rows = len(keep_rows) + sum(new_counts)
        capacity = length + reserve
        template = new_kv[0][0][0] if new_kv else self.keys[0]
        heads, head_dim = template.shape[1], template.shape[3]

        mask = torch.zeros(rows, capacity, dtype=torch.bool, device=self.device)
        positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        n_keep = len(keep_rows)
        if n_keep:
            mask[:n_keep, length - kept_len : length] = old_mask[:, first_used:]
            positions[:n_keep] = self.positions[keep]
        # Only the left padding (columns before ``length`` a row does not fill) must be
        # zeroed: attention reads it, masked, so it must stay finite. Columns from
        # ``length`` on are always written before they are read.
        same_rows = keep_rows == list(range(self.rows))
        keys, values = [], []
        for layer in range(self.num_layers):
            k_buf = torch.empty(
                rows, heads, capacity, head_dim, dtype=self.dtype, device=self.device
            )
            v_buf = torch.empty_like(k_buf)
            for old, buf in ((self.keys, k_buf), (self.values, v_buf)):
                if n_keep:
                    buf[:n_keep, :, : length - kept_len].zero_()
                    src = old[layer][:, :, first_used : self.length]
                    buf[:n_keep, :, length - kept_len : length] = src if same_rows else src[keep]
            row = n_keep
            for (nk, nv), count, plen in zip(new_kv, new_counts, new_lens, strict=True):
                k_buf[row : row + count, :, : length - plen].zero_()
                v_buf[row : row + count, :, : length - plen].zero_()
                k_buf[row : row + count, :, length - plen : length] = nk[layer]
                v_buf[row : row + count, :, length - plen : length] = nv[layer]
                row += count
            keys.append(k_buf)
            values.append(v_buf)
        row = n_keep
        for count, plen in zip(new_counts, new_lens, strict=True):
            mask[row : row + count, length - plen : length] = True
            positions[row : row + count] = plen
            row += count
        self.keys, self.values, self.mask, self.positions = keys, values, mask, positions
        self.length = length

    def clear(self) -> None:
        self.keys, self.values = [], []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.length = 0

    def ensure_room(self, columns: int = 1) -> None:
        """Grow the buffers if fewer than ``columns`` free columns remain."""
        if self.length + columns <= self.capacity:
            return
        self.rebuild(list(range(self.rows)), [], reserve=max(GROWTH_COLUMNS, self.length))

    def step_mask(self) -> torch.Tensor:
        """Mark column ``length`` valid for every row; return the 2-D bool mask a decode step uses."""
        self.mask[:, self.length] = True
        return self.mask[:, : self.length + 1]

    def advance(self) -> None:
        """After a decode step: one more column written, one more real token per row."""
        self.length += 1
        self.positions += 1

    def hf_cache(self) -> Cache:
        layers = [
            _InPlaceLayer(k, v, self.length) for k, v in zip(self.keys, self.values, strict=True)
        ]
        return Cache(layers=layers)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefillCache:
    """Logits ``[1, V]`` and per-layer KV ``[1, kv_heads, P, head_dim]`` of prefilled token
    sequences, keyed by their exact tokens; least recently used first out past ``max_bytes``.

    Entries are only valid for the weights that computed them: the scheduler clears
    the cache whenever weights or the weight version change, and on ``/flush_cache``.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"prefill cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], PrefillEntry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        return self._bytes

    def get(self, tokens: tuple[int, ...]) -> PrefillEntry | None:
        entry = self._entries.get(tokens)
        if entry is not None:
            self._entries.move_to_end(tokens)
        return entry

    def put(
        self,
        tokens: tuple[int, ...],
        logits: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> PrefillEntry:
        """Store one row (clones, so the batch's tensors are not kept alive); returns it."""
        entry = PrefillEntry(logits.clone(), [k.clone() for k in keys], [v.clone() for v in values])
        if self.max_bytes == 0 or entry.nbytes > self.max_bytes:
            return entry
        old = self._entries.pop(tokens, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._entries[tokens] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


class PrefillEntry:
    """One prefilled token sequence: its last logits and its KV, batch dimension 1."""

    __slots__ = ("keys", "logits", "nbytes", "values")

    def __init__(
        self, logits: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> None:
        self.logits = logits
        self.keys = keys
        self.values = values
        self.nbytes = sum(t.numel() * t.element_size() for t in (logits, *keys, *values))
