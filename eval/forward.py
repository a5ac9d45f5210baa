"""How the engine runs a model's forward: its static cache, its attention, compiled or not.

A :class:`ModelForward` wraps one module the engine calls every round (the target, a draft LM, an
EAGLE head): it owns the module's :class:`draftsmith.eval.kv.StaticCache` (allocated once, reused by every
generation), switches the module's attention to the engine's (:mod:`draftsmith.eval.attention`) for the call,
names the cache slots the call writes, and, with ``compile=True``, runs the call through
``torch.compile``.

Compiling. Every round feeds the same module the same kinds of tensors: token ids (1, q),
positions (1, q), the engine's additive mask (1, 1, q, kv) and the cache slots (q,). Only q and kv
change, and they are dynamic dimensions of the compiled graph, so a whole benchmark compiles two
graphs per module and set of outputs (q = 1, plain decoding; q >= 2, every tree size; a target
also returning hidden states for an EAGLE head or a block draft has its own pair) whatever its
tree sizes and context lengths; :attr:`ModelForward.compile_seconds` is the time the calls that compiled took,
which the benchmark reports apart from the decoding it measures. The guards on the module's
parameters are skipped (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``): the weights of
a frozen target and of a loaded draft do not change while the engine runs. Calls that keep only
the last logits (a prompt's prefill) run eagerly: they happen once per prompt, with shapes no
round repeats. On CUDA the same graphs could be captured as CUDA graphs (``mode="reduce-
overhead"``); draftsmith has not measured that path yet, so it compiles the same way there.
"""

from __future__ import annotations

import sys
import time
import types
import weakref

import torch
from torch._dynamo.utils import counters

from draftsmith.eval.attention import engine_attention, layer_masks
from draftsmith.eval.kv import MIN_CAPACITY, StaticCache

_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILING = [0.0]  # seconds every ModelForward of this process has spent compiling
COMPILE_MODES = ("off", "on", "max")
# "max": inductor autotunes every matrix product between aten's and its own C++ GEMM kernels
# and calls its kernels from C++ rather than Python (weights are frozen into graphs that hold
# them; draftsmith's pass the module as an argument, so they stay inputs). On a 2-core Xeon it
# took a plain round of SmolLM2-135M from 33.5 ms ("on") to 27-29 ms and a round verifying 8
# tokens from 67 to 47-54 ms, for 4-5 minutes of compiling instead of 2.
_OPTIONS = {
    "on": {},
    "max": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "cpp_wrapper": True},
}


def compile_mode(value) -> str:
    """True / False / "on" / "off" / "max" -> one of :data:`COMPILE_MODES`."""
    if value is True:
        return "on"
    if value is False or value is None:
        return "off"
    if value not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {value!r}")
    return value


class ModelForward:
    """One module's forward as the engine runs it (see the module docstring).

    ``call(module, **kwargs)`` is how the module is called with the engine's tensors: for a
    transformers causal LM :func:`causal_lm_call` (the default), for an EAGLE head its own.
    """

    def __init__(self, module: torch.nn.Module, *, compile: bool | str = False, call=None,
                 cache_config=None):
        self.module = module
        self.call = call or causal_lm_call
        self.cache = StaticCache(cache_config if cache_config is not None else module.config,
                                 MIN_CAPACITY)
        self.compile = compile_mode(compile)
        self.compile_seconds = 0.0
        self._compiled = None
        self.graphs = 0  # graphs compiled for this module
        self.owner = None  # the generation holding the cache now

    def take_cache(self, owner) -> StaticCache:
        """The cache, emptied, for a new generation ``owner``; an unfinished earlier one loses it."""
        self.owner = owner
        self.cache.set_length(0)
        return self.cache

    def check_owner(self, owner) -> None:
        if self.owner is not owner:
            raise ValueError("this generation's cache was taken by a later generation on the same "
                             "model: finish one generation before beginning the next")

    def _compiled_call(self):
        if self._compiled is None:
            print(f"[compile] {type(self.module).__name__}: compiling its forward ({self.compile}"
                  "; two graphs, each at its first use: minutes on a CPU, once per process, not "
                  "counted in any method's seconds)", file=sys.stderr, flush=True)
            options = {**_OPTIONS[self.compile],
                       "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
            self._compiled = torch.compile(_own_code(self.call, id(self)), dynamic=True,
                                           options=options)
        return self._compiled

    def __call__(self, slots: torch.Tensor, *, eager: bool = False, **kwargs):
        """The module's forward writing its new entries at ``slots`` (a (q,) device tensor); the
        caller moves the cache's length pointer afterwards. ``eager``: never compiled (a
        prefill)."""
        cache = self.cache
        cache.reserve(int(slots.shape[0]) + max(cache.length, 0) + 1)
        cache.slots = slots
        if "position_ids" in kwargs:  # a sliding window masks by the entries' positions
            cache.record_positions(slots, kwargs["position_ids"])
        try:
            with engine_attention(self.module), torch.no_grad():
                if self.compile == "off" or eager:
                    return self.call(self.module, cache=cache, **kwargs)
                before = counters["stats"]["unique_graphs"]
                started = time.perf_counter()
                kwargs = {key: _standalone(value) for key, value in kwargs.items()}
                with _no_duck_sizing():
                    out = self._compiled_call()(self.module, cache=cache, **kwargs)
                new = counters["stats"]["unique_graphs"] - before
                if new:  # this call compiled (dynamo counts every graph it makes)
                    self.graphs += new
                    spent = time.perf_counter() - started
                    self.compile_seconds += spent
                    _COMPILING[0] += spent
                return out
        finally:
            cache.slots = None


def _own_code(fn, tag):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs, and its limit of
    recompiles (8, after which it runs the function eagerly without a word), per code object:
    a target (4 graphs with and without hidden states), a draft LM and a second head of another
    shape all calling ``causal_lm_call`` would share one list and one limit, and a module's
    graphs and compile seconds could not be told apart. Each ModelForward compiles its own.
    (The weights stay graph inputs even under "max": the module is an argument, so a graph run
    on another module of the same shapes computes with that module's weights.)"""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return own


def _standalone(value):
    """A tensor argument as a compiled graph should see it: contiguous and not a view. Dynamo
    guards on a view's base and on strides, so a slice of a longer buffer (an EAGLE head's
    pending features, the last row of a wider output) would compile a graph of its own each time
    its base's length or stride differs; a copy of a few rows costs microseconds."""
    if isinstance(value, torch.Tensor) and (value._base is not None or not value.is_contiguous()):
        return value.clone(memory_format=torch.contiguous_format)
    return value


def _no_duck_sizing():
    """Dynamo's duck sizing makes two dimensions of equal size one symbol (a mask's key length
    equal by chance to a feature slice's base length) and recompiles when they part; the
    engine's dimensions are independent, so each gets its own symbol."""
    return torch.fx.experimental._config.patch(use_duck_shape=False)


def causal_lm_call(model, *, cache, input_ids, position_ids, attention_mask,
                   output_hidden_states: bool = False, logits_to_keep: int = 0):
    """A transformers causal LM over the engine's tensors -> its output (logits, hidden states)."""
    attention_mask = layer_masks(cache, attention_mask, position_ids)
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                 cache=cache, use_cache=True, output_hidden_states=output_hidden_states,
                 logits_to_keep=logits_to_keep)


def model_forward(module: torch.nn.Module, *, role: str = "target", compile: bool | str = False,
                  call=None, cache_config=None) -> ModelForward:
    """The one :class:`ModelForward` of ``module`` in ``role`` ("target" or "draft": a target
    may draft for itself, with a cache of its own), made at the first request; asking again with
    another ``compile`` mode (:func:`compile_mode`) than the one it compiled with starts over."""
    forwards = _FORWARDS.setdefault(module, {})
    forward = forwards.get(role)
    mode = compile_mode(compile)
    if forward is None:
        forward = ModelForward(module, compile=mode, call=call, cache_config=cache_config)
        forwards[role] = forward
    elif mode != forward.compile and mode != "off":
        forward.compile, forward._compiled = mode, None
    return forward


def compiling_seconds() -> float:
    """Seconds this process has spent compiling engine forwards so far (a clock to subtract)."""
    return _COMPILING[0]


def compiled_forwards() -> dict[str, float]:
    """Every compiled module's compile seconds so far: ``<class> (<role>)`` -> seconds."""
    found = {}
    for module, forwards in list(_FORWARDS.items()):
        for role, forward in forwards.items():
            if forward.compile_seconds:
                name = f"{type(module).__name__} ({role})"
                found[name] = found.get(name, 0.0) + forward.compile_seconds
    return found
