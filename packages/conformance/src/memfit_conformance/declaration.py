"""Check an adapter's declaration against the real model, once, before any combination runs.

A wrong declaration (a typo in a block list, an undeclared block class, a module in two regions, a
"chain" whose modules are not called one after the other, a region that saves nothing) would otherwise
fail a hundred combination tests with indirect messages. :func:`check_declaration` finds each such
problem, names the block list, the block class, the region and the path, and says how to fix it; the
kit fails one test with the list and skips the rest (:class:`~memfit_conformance.AdapterConformance`).

Three passes, each only when the previous one found nothing (a path that does not resolve cannot be run):

1. the adapter is discoverable and its entry-point name is its ``name``; the model is of a declared class;
   every declared block list exists, is a non-empty ``nn.ModuleList`` and its length matches the config;
   every block class in those lists is declared; a declared model-owned checkpointing switch exists;
2. every region path resolves, no module belongs to two regions, no region lies inside another;
3. one forward of the unmodified model, observed: every region runs once per block call, every later
   module of a chain consumes an earlier one's output, every attention region calls
   ``scaled_dot_product_attention`` (or its block says why not), and every FFN region frees, when
   recomputed, more bytes than its recompute keeps (see ``MIN_FREED_PER_KEPT``).
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from memfit import FamilyAdapter, find_adapter
from memfit.accounting import tensor_storages
from memfit.adapters.discovery import ENTRY_POINT_GROUP
from memfit.adapters.spec import BlockSpec, Region

# An FFN region must free, when recomputed, at least as many bytes as its recompute keeps (its inputs): a
# feed-forward frees its wide hidden activations, 4-11x its input at every shipped adapter; a norm frees two
# floats per token, a lone projection nothing. Measured against the region's own input rather than as a
# share of its block, because that share depends on the preset's token mix (a text-stream FFN of a
# two-stream block is 3% of its block at a tiny preset with 8 text tokens, a norm 0.3-0.5%).
MIN_FREED_PER_KEPT = 1.0


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a declaration: where (block list, class, region, path), what, and the fix."""

    where: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}\n     Fix: {self.fix}"


def describe(adapter: FamilyAdapter, model: nn.Module | None, problems: list[Problem]) -> str:
    """The failure message: every problem, numbered."""
    on = f" (checked on {type(model).__name__})" if model is not None else ""
    lines = [f"memfit adapter {adapter.name!r}: {len(problems)} problem(s) in the declaration{on}:"]
    lines += [f"  {i}. {p}" for i, p in enumerate(problems, 1)]
    return "\n".join(lines)


def check_declaration(
    adapter: FamilyAdapter,
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    discovery: bool = True,
) -> list[Problem]:
    """Every problem of ``adapter``'s declaration on ``model`` (empty: the declaration is sound).

    Args:
        adapter: the declaration under test.
        model: a model built by one of its presets (the kit uses ``tiny``).
        inputs: forward kwargs for ``model``; the third pass runs one forward with gradients.
        discovery: also check the ``memfit.adapters`` entry point (off for adapters built inside a test).
    """
    problems = check_entry_point(adapter, model) if discovery else []
    problems += check_block_lists(adapter, model)
    problems += check_model_switch(adapter, model)
    if not problems:
        problems += check_region_paths(adapter, model)
    if not problems:
        problems += check_regions_running(adapter, model, inputs)
    return problems


# -- pass 1: discovery, model class, block lists, block classes ------------------------------------------------


def check_entry_point(adapter: FamilyAdapter, model: nn.Module) -> list[Problem]:
    """The adapter is installed under an entry point named like the adapter, and serves ``model``."""
    where = f"entry point group {ENTRY_POINT_GROUP!r}"
    registered = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == adapter.name]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = ep.load()
        except Exception as exc:
            return [
                Problem(
                    f"{where}, entry point {ep.name!r}",
                    f"loading {ep.value!r} raised {type(exc).__name__}: {exc}",
                    "fix the import (memfit loads every installed adapter to find the one serving a model)",
                )
            ]
        if loaded is adapter and ep.name != adapter.name:
            return [
                Problem(
                    where,
                    f"entry point {ep.name!r} loads the adapter named {adapter.name!r}: "
                    f"memfit.get_adapter({ep.name!r}) would fail",
                    f'use one name for both: `{adapter.name} = "{ep.value}"` in pyproject.toml '
                    f"(or name={ep.name!r} in the FamilyAdapter), then reinstall the package",
                )
            ]
    if not registered:
        return [
            Problem(
                where,
                f"no installed entry point is named {adapter.name!r}, so memfit cannot discover the adapter",
                f'declare `[project.entry-points."{ENTRY_POINT_GROUP}"] {adapter.name} = "<module>:ADAPTER"` '
                f"in pyproject.toml and install the package (`pip install -e .`): entry points exist only "
                f"for installed distributions",
            )
        ]
    found = find_adapter(model)
    if found is not None and found.name != adapter.name:
        return [
            Problem(
                where,
                f"{type(model).__name__} is served by the installed adapter {found.name!r}, not by {adapter.name!r}",
                "uninstall the other adapter, or narrow one adapter's model_classes",
            )
        ]
    return []


def check_block_lists(adapter: FamilyAdapter, model: nn.Module) -> list[Problem]:
    """Model class, 'tiny' preset, block lists, config counts, and every block class declared."""
    problems = []
    model_name = type(model).__name__
    if not adapter.matches(model):
        problems.append(
            Problem(
                "model_classes",
                f"{adapter.model_classes} does not include {model_name} (nor a class it derives from), the class "
                f"the preset builds",
                f'add "{model_name}" to model_classes',
            )
        )
    if "tiny" not in adapter.presets:
        problems.append(
            Problem(
                "presets", "no 'tiny' preset", "add a 'tiny' Preset: the kit and `memfit fit` default to it"
            )
        )
    lists = _ModuleLists(model)
    seen: dict[int, str] = {}
    for path in adapter.block_lists:
        where = f"block list {path!r}"
        container, missing = lists.resolve(path)
        if missing:
            problems.append(Problem(where, missing, f"correct the path in block_lists{lists.suggest(path)}"))
            continue
        if container is None:
            problems.append(
                Problem(
                    where,
                    f"is None on this {model_name}",
                    "configure the tiny preset so every declared list is built, or the kit checks nothing for it",
                )
            )
            continue
        if not isinstance(container, nn.ModuleList) or len(container) == 0:
            what = "is empty" if isinstance(container, nn.ModuleList) else f"is a {type(container).__name__}"
            problems.append(
                Problem(
                    where,
                    f"{what}, not a non-empty nn.ModuleList of blocks",
                    "declare the blocks' ModuleList",
                )
            )
            continue
        if id(container) in seen:
            problems.append(
                Problem(where, f"is the same ModuleList as {seen[id(container)]!r}", "declare each list once")
            )
            continue
        seen[id(container)] = path
        problems += _check_count(adapter, model, path, container)
        problems += _check_block_classes(adapter, path, container)
    if not problems:  # a list that does not resolve is usually the one the model's repeated blocks sit in
        problems += _check_undeclared_lists(adapter, model, seen)
    return problems


class _ModuleLists:
    """Resolves declared list paths on a model and suggests the closest real ones."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # lists of the model, not lists inside its blocks (whose paths run through an index)
        self.names = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and n and not any(part.isdigit() for part in n.split("."))
        ]

    def resolve(self, path: str) -> tuple[Any, str]:
        parent_path, _, name = path.rpartition(".")
        try:
            parent = self.model.get_submodule(parent_path) if parent_path else self.model
        except AttributeError:
            return None, f"{type(self.model).__name__} has no submodule {parent_path!r}"
        if not name or not hasattr(parent, name):
            return None, f"{type(self.model).__name__} has no attribute {path!r}"
        return getattr(parent, name), ""

    def suggest(self, path: str) -> str:
        close = difflib.get_close_matches(path, self.names, n=2, cutoff=0.5)
        if close:
            return f" (did you mean {' or '.join(repr(c) for c in close)}?)"
        return f" (the model's ModuleLists: {', '.join(self.names) or 'none'})"


def _check_count(
    adapter: FamilyAdapter, model: nn.Module, path: str, container: nn.ModuleList
) -> list[Problem]:
    key = adapter.block_count_config.get(path)
    if key is None:
        return []
    config = getattr(model, "config", None)
    if config is None:  # a class without a config (an upstream base class the adapter also serves)
        return []
    # diffusers configs are mappings, transformers configs have attributes
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    where = f"block_count_config[{path!r}]"
    if value is None:
        return [
            Problem(
                where, f"the model config has no key {key!r}", "name the config key holding the list's length"
            )
        ]
    if value != len(container):
        return [
            Problem(
                where,
                f"config[{key!r}] = {value} but {path!r} holds {len(container)} blocks",
                "name the config key that holds this list's length",
            )
        ]
    return []


def check_model_switch(adapter: FamilyAdapter, model: nn.Module) -> list[Problem]:
    """The declared model-owned checkpointing switch is where the declaration says: the attribute on the model,
    the key in its config (when the model has a config: a base class the adapter also serves may have none)."""
    switch = adapter.model_checkpoint_switch
    if switch is None:
        return []
    problems = []
    model_name = type(model).__name__
    if switch.attribute and not hasattr(model, switch.attribute):
        problems.append(
            Problem(
                "model_checkpoint_switch.attribute",
                f"{model_name} has no attribute {switch.attribute!r}, so memfit could never see the switch on",
                "name the attribute the model's forward reads to checkpoint its blocks itself (or leave it empty)",
            )
        )
    config = getattr(model, "config", None)
    if switch.config_key and config is not None:
        present = (
            switch.config_key in config if isinstance(config, Mapping) else hasattr(config, switch.config_key)
        )
        if not present:
            problems.append(
                Problem(
                    "model_checkpoint_switch.config_key",
                    f"the config of {model_name} has no key {switch.config_key!r}",
                    "name the config key that holds the model's own checkpointing switch (or leave it empty)",
                )
            )
    return problems


def _check_block_classes(adapter: FamilyAdapter, path: str, container: nn.ModuleList) -> list[Problem]:
    problems = []
    for cls_name, indices in _group_by_class(container).items():
        block = container[indices[0]]
        if adapter.spec_for(block) is not None:
            continue
        close = difflib.get_close_matches(cls_name, list(adapter.blocks), n=1, cutoff=0.6)
        hint = f" (blocks declares {close[0]!r}: a typo?)" if close else ""
        problems.append(
            Problem(
                f"{path}{_indices(indices)} ({cls_name})",
                f"the block class {cls_name} is not declared in `blocks`{hint}",
                f'add "{cls_name}": BlockSpec(ffn=..., attention=...) to blocks (BlockSpec() if it has no '
                f"safe sub-block boundary)",
            )
        )
    return problems


def _check_undeclared_lists(
    adapter: FamilyAdapter, model: nn.Module, declared: dict[int, str]
) -> list[Problem]:
    """ModuleLists of the blocks diffusers marks as repeated (``_repeated_blocks``) that no list declares."""
    repeated = set(getattr(model, "_repeated_blocks", None) or ())
    problems = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or id(module) in declared or len(module) == 0:
            continue
        classes = {type(b).__name__ for b in module}
        if classes & repeated:
            problems.append(
                Problem(
                    f"block list {name!r}",
                    f"holds {', '.join(sorted(classes))} blocks ({type(model).__name__}._repeated_blocks) but is "
                    f"not in block_lists: memfit would not checkpoint them",
                    f"add {name!r} to block_lists, in the order the forward calls the lists",
                )
            )
    return problems


# -- pass 2: region paths and overlaps --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Member:
    kind: str  # "FFN" | "attention"
    region: Region
    path: str
    module: nn.Module

    def label(self) -> str:
        return f"{self.kind} region {self.region}"


def _regions(spec: BlockSpec) -> Iterator[tuple[str, Region]]:
    for region in spec.ffn:
        yield "FFN", region
    for region in spec.attention:
        yield "attention", region


def check_region_paths(adapter: FamilyAdapter, model: nn.Module) -> list[Problem]:
    """Every region path resolves on its block; no module in two regions; no region inside another."""
    problems = []
    for path, container in adapter.resolve_block_lists(model).items():
        for cls_name, indices in _group_by_class(container).items():
            block = container[indices[0]]
            where = f"{path}{_indices(indices)} ({cls_name})"
            members, missing = _resolve_members(adapter.spec_for(block), block, where)
            problems += missing
            if not missing:
                problems += _overlaps(members, where)
    return problems


def _resolve_members(spec: BlockSpec, block: nn.Module, where: str) -> tuple[list[_Member], list[Problem]]:
    members, problems = [], []
    children = [n for n, _ in block.named_children()]
    names = [n for n, _ in block.named_modules() if n]
    for kind, region in _regions(spec):
        if not region:
            problems.append(Problem(where, f"an empty {kind} region", "remove it, or name its sub-module(s)"))
        for sub in region:
            try:
                module = block.get_submodule(sub) if sub else None
            except AttributeError:
                module = None
            if module is None or module is block:
                close = difflib.get_close_matches(
                    sub, children, n=2, cutoff=0.4
                ) or difflib.get_close_matches(sub, names, n=2, cutoff=0.5)
                hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
                problems.append(
                    Problem(
                        f"{where}, {kind} region {region}",
                        f"{sub!r} is not a sub-module of {type(block).__name__}{hint}",
                        "give the attribute path of a sub-module the block calls, relative to the block",
                    )
                )
            else:
                members.append(_Member(kind, region, sub, module))
    return members, problems


def _overlaps(members: list[_Member], where: str) -> list[Problem]:
    problems = []
    for a, b in itertools.combinations(members, 2):
        if a.module is b.module:
            same = a.region == b.region and a.kind == b.kind
            what = (
                f"{a.path!r} appears twice in {a.label()}"
                if same
                else f"{a.path!r} is in {a.label()} and {b.path!r} in {b.label()}: the same module"
            )
            fix = (
                "a module belongs to one region only: keep it in the region it is (the feed-forward in `ffn`, "
                "the module that computes attention in `attention`) and remove it from the other"
            )
            problems.append(Problem(where, what, fix))
            continue
        outer, inner = (a, b) if _contains(a.module, b.module) else (b, a)
        if _contains(outer.module, inner.module):
            problems.append(
                Problem(
                    where,
                    f"{inner.path!r} ({inner.label()}) lies inside {outer.path!r} ({outer.label()}): regions must "
                    f"not nest or overlap",
                    f"declare only one of them (usually the outer {outer.path!r})",
                )
            )
    return problems


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


# -- pass 3: one observed forward -------------------------------------------------------------------------------


@dataclass
class _RegionRun:
    """What one declared region of one block did during the observed forward."""

    where: str
    kind: str
    region: Region
    modules: tuple[nn.Module, ...]
    attention_without_sdpa: str
    starts: int = 0
    member_calls: list[int] = field(default_factory=list)
    chain_break: str = ""
    out_of_order: str = ""
    sdpa_calls: int = 0
    entries: dict[tuple[str, int], int] = field(
        default_factory=dict
    )  # storage -> bytes, kept for a recompute
    active: int = 0
    outputs: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # this call's chain outputs
    next_member: int = 0

    def label(self) -> str:
        return f"{self.where}, {self.kind} region {self.region}"


@dataclass
class _BlockRun:
    regions: list[_RegionRun]
    calls: int = 0
    active: int = 0
    entries: set[tuple[str, int]] = field(default_factory=set)
    # storage -> (bytes, ids of this block's regions active at each save of it)
    saved: dict[tuple[str, int], tuple[int, list[frozenset[int]]]] = field(default_factory=dict)


def check_regions_running(
    adapter: FamilyAdapter, model: nn.Module, inputs: Mapping[str, Any]
) -> list[Problem]:
    """Run one forward with gradients, watch every declared region, and report what is wrong with them."""
    observer = _Observer(adapter, model)
    try:
        with observer, torch.enable_grad():
            output = model(**inputs)
        del output
    finally:
        observer.remove()
    problems = []
    reported: set[tuple[str, str]] = set()
    for block_run in observer.blocks.values():
        for run in block_run.regions:
            for problem in _region_problems(run, block_run):
                key = (problem.where, problem.fix)
                if key not in reported:  # one line per block class and kind of problem, not per block
                    reported.add(key)
                    problems.append(problem)
    return problems


def _region_problems(run: _RegionRun, block: _BlockRun) -> list[Problem]:
    where = run.label()
    if block.calls == 0:
        return []  # the block itself did not run (an optional branch): nothing to judge
    if run.starts == 0:
        return [
            Problem(
                where,
                f"never ran: the block did not call {run.region[0]!r} with the preset's inputs",
                "declare only sub-modules the block's forward calls (and make the tiny preset call them)",
            )
        ]
    if run.out_of_order:
        return [
            Problem(where, run.out_of_order, "list the chain's modules in the order the block calls them")
        ]
    if run.chain_break:
        return [
            Problem(
                where,
                f"is not a chain: {run.chain_break}",
                "declare the modules as separate regions, or only the part that is a chain",
            )
        ]
    problems = []
    if run.starts != block.calls or any(n != run.starts for n in run.member_calls):
        problems.append(
            Problem(
                where,
                f"ran {max(run.member_calls)} times in {block.calls} call(s) of its block; a region must run "
                f"exactly once per block call",
                "declare a module the block calls once (a module shared between two calls cannot be a region)",
            )
        )
    if run.kind == "attention" and run.sdpa_calls == 0 and not run.attention_without_sdpa:
        problems.append(
            Problem(
                where,
                "does not call torch.nn.functional.scaled_dot_product_attention: it does not look like attention",
                "declare the module that computes attention (e.g. 'attn'), or, if this family computes attention "
                "with another kernel, say which in BlockSpec(attention_without_sdpa=...)",
            )
        )
    if run.kind == "FFN":
        freed, kept = _freed_bytes(run, block), _entry_bytes(run)
        if freed < MIN_FREED_PER_KEPT * kept:
            share = freed / max(_block_bytes(block), 1)
            problems.append(
                Problem(
                    where,
                    f"saves (almost) nothing: recomputing it frees {freed} bytes ({share:.1%} of what its block "
                    f"saves for backward) and keeps its {kept} input bytes for the recompute; a feed-forward "
                    f"frees several times its input",
                    "declare the feed-forward module itself (the one holding the wide hidden activations)",
                )
            )
    return problems


def _freed_bytes(run: _RegionRun, block: _BlockRun) -> int:
    """Bytes saved only inside ``run``'s region, minus its entries (a recompute keeps those)."""
    rid = id(run)
    return sum(
        nbytes
        for key, (nbytes, saves) in block.saved.items()
        if key not in run.entries and all(rid in active for active in saves)
    )


def _entry_bytes(run: _RegionRun) -> int:
    return sum(run.entries.values())


def _block_bytes(block: _BlockRun) -> int:
    return sum(nbytes for key, (nbytes, _) in block.saved.items() if key not in block.entries)


class _Observer(TorchFunctionMode):
    """Forward hooks on every declared block and region module, saved-tensor hooks, and an SDPA counter."""

    def __init__(self, adapter: FamilyAdapter, model: nn.Module) -> None:
        super().__init__()
        self.params = {
            (t.device.type, s.data_ptr())
            for t in itertools.chain(model.parameters(), model.buffers())
            for s in tensor_storages(t)  # a quantized weight by the tensors it wraps
        }
        self.blocks: dict[nn.Module, _BlockRun] = {}
        self.handles: list[Any] = []
        for path, container in adapter.resolve_block_lists(model).items():
            groups = _group_by_class(container)
            for cls_name, indices in groups.items():
                for index in indices:
                    self._watch_block(adapter, container[index], f"{path}{_indices(indices)} ({cls_name})")
        self.saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)

    def _watch_block(self, adapter: FamilyAdapter, block: nn.Module, where: str) -> None:
        spec = adapter.spec_for(block)
        runs = []
        for kind, region in _regions(spec):
            modules = tuple(block.get_submodule(p) for p in region)
            run = _RegionRun(
                where, kind, region, modules, spec.attention_without_sdpa, member_calls=[0] * len(modules)
            )
            runs.append(run)
            for position, module in enumerate(modules):
                self.handles.append(
                    module.register_forward_pre_hook(_MemberPre(self, run, position), with_kwargs=True)
                )
                self.handles.append(module.register_forward_hook(_MemberPost(run, position)))
        block_run = self.blocks[block] = _BlockRun(runs)
        self.handles.append(block.register_forward_pre_hook(_BlockPre(self, block_run), with_kwargs=True))
        self.handles.append(block.register_forward_hook(_BlockPost(block_run)))

    def __enter__(self) -> _Observer:
        self.saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.saved_hooks.__exit__(*exc)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            for block in self.blocks.values():
                for run in block.regions:
                    if run.active:
                        run.sdpa_calls += 1
        return func(*args, **(kwargs or {}))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return tensor
        key = _key(tensor)
        if key[1] == 0 or key in self.params:
            return tensor
        for block in self.blocks.values():
            if block.active:
                active = frozenset(id(r) for r in block.regions if r.active)
                nbytes, saves = block.saved.setdefault(key, (tensor.untyped_storage().nbytes(), []))
                saves.append(active)
        return tensor

    def tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        flat, _ = tree_flatten((args, kwargs))
        return [x for x in flat if isinstance(x, torch.Tensor)]


class _BlockPre:
    def __init__(self, observer: _Observer, run: _BlockRun) -> None:
        self.observer, self.run = observer, run

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.run.calls += 1
        self.run.active += 1
        self.run.entries.update(_key(t) for t in self.observer.tensors(args, kwargs))


class _BlockPost:
    def __init__(self, run: _BlockRun) -> None:
        self.run = run

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.run.active -= 1


class _MemberPre:
    """Before a region's module runs: count it, check it continues the chain, note its entries."""

    def __init__(self, observer: _Observer, run: _RegionRun, position: int) -> None:
        self.observer, self.run, self.position = observer, run, position

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        run, position = self.run, self.position
        tensors = self.observer.tensors(args, kwargs)
        if position == 0:
            run.starts += 1
            run.outputs = []
        elif run.next_member != position and not run.out_of_order:
            previous = run.region[position - 1]
            run.out_of_order = f"{run.region[position]!r} ran without {previous!r} right before it"
        elif not run.chain_break and not any(_is_output(t, run.outputs) for t in tensors):
            run.chain_break = (
                f"{run.region[position]!r} does not take an output of {', '.join(map(repr, run.region[:position]))} "
                f"(something else runs in between)"
            )
        for t in tensors:
            if not _is_output(t, run.outputs):
                run.entries[_key(t)] = t.untyped_storage().nbytes()
        run.member_calls[position] += 1
        run.active += 1


class _MemberPost:
    def __init__(self, run: _RegionRun, position: int) -> None:
        self.run, self.position = run, position

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        run = self.run
        run.active -= 1
        flat, _ = tree_flatten(output)
        run.outputs += [(t, t._version) for t in flat if isinstance(t, torch.Tensor)]
        run.next_member = (self.position + 1) % len(run.modules)
        if run.next_member == 0:
            run.outputs = []  # the region call is complete: drop the references


def _is_output(tensor: torch.Tensor, outputs: list[tuple[torch.Tensor, int]]) -> bool:
    return any(t is tensor and t._version == version for t, version in outputs)


def _key(tensor: torch.Tensor) -> tuple[str, int]:
    return tensor.device.type, tensor.untyped_storage().data_ptr()


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _group_by_class(container: nn.ModuleList) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for index, block in enumerate(container):
        groups.setdefault(type(block).__name__, []).append(index)
    return groups


def _indices(indices: list[int]) -> str:
    """``[0]``, ``[0..3]`` or ``[0, 2, 5]``: the blocks a message is about."""
    if len(indices) == 1:
        return f"[{indices[0]}]"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"[{indices[0]}..{indices[-1]}]"
    return f"[{', '.join(map(str, indices))}]"
