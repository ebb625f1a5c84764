"""Object keys of tsukimi's HiCache backend: which store objects hold one SGLang page.

    sglang/{model}/{page_key}/{suffix}                 a KV page (one object per suffix)
    sglang/{model}/{page_key}/{suffix}/{pool}          the page of a v2 side pool (Mamba, SWA...)
    sglang/{model}/{page_key}/{suffix}/flat            a page by the legacy get/set calls (SGLang's
                                                       generic path: one flat tensor per page)

The suffix tells ranks apart the way SGLang's MooncakeStore does:

    MHA                  "{tp_rank}"   (+ "_pp{pp_rank}" with pipeline parallelism)
    MHA, split heads     one suffix per target rank tp_rank*f .. tp_rank*f+f-1, f = lcm/tp
    MLA                  "mla"         (rank-independent; + "_dcp{d}_cp{c}", + "_pp{pp_rank}")

`model` is the model tag (extra_config "model_tag", else SGLang's model name) with "/" as "-";
with decode context parallelism it carries the topology too, as MooncakeStore's prefix does.
Pure: no SGLang import (the backend hands the config's fields in).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "sglang"


@dataclass(frozen=True, slots=True)
class RankLayout:
    """The parts of SGLang's HiCacheStorageConfig a key depends on."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla: bool = False
    split_factor: int = 0  # NOTE: 0 unless SGLang asked to split heads (tp_lcm_size // tp_size)
    dcp_rank: int = 0
    dcp_size: int = 1
    attn_cp_rank: int = 0
    logical_page_size: int = 0


@dataclass(frozen=True, slots=True)
class PageKeys:
    """The key scheme of one backend instance (see the module). Pure."""

    model: str
    suffixes: tuple[str, ...]

    @classmethod
    def build(cls, model: str, layout: RankLayout) -> PageKeys:
        """The keys of `model` (a tag or SGLang's model name) for one rank's `layout`."""
        tag = (model or "default").replace("/", "-")
        if layout.dcp_size > 1:
            tag += f"-tp{layout.tp_size}_dcp{layout.dcp_size}_page{layout.logical_page_size}_pp{layout.pp_size}"
        pp = f"_pp{layout.pp_rank}" if layout.pp_size > 1 else ""
        if layout.is_mla:
            dcp = f"_dcp{layout.dcp_rank}_cp{layout.attn_cp_rank}" if layout.dcp_size > 1 else ""
            return cls(tag, (f"mla{dcp}{pp}",))
        if layout.split_factor > 0:
            base = layout.tp_rank * layout.split_factor
            return cls(tag, tuple(f"{base + i}{pp}" for i in range(layout.split_factor)))
        return cls(tag, (f"{layout.tp_rank}{pp}",))

    @property
    def per_page(self) -> int:
        """Objects per KV page."""
        return len(self.suffixes)

    def page_objects(self, page_keys: list[str], pool: str = "") -> list[str]:
        """The object keys of `page_keys`, page by page, `per_page` each; `pool` names a v2
        side pool ("" for KV)."""
        tail = f"/{pool}" if pool else ""
        base = f"{PREFIX}/{self.model}/"
        return [f"{base}{page}/{suffix}{tail}" for page in page_keys for suffix in self.suffixes]

    def raw(self, key: str) -> str:
        """The store key of a legacy call's `key` (this rank's first suffix: the generic path
        moves a rank's whole page as one flat tensor)."""
        return f"{PREFIX}/{self.model}/{key}/{self.suffixes[0]}/flat"
