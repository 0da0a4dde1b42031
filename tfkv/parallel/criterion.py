"""The loss a run trains on and the metrics it reports, from the config's `loss` and `metrics`.

`loss` is a Keras name ("mse", "mae", "binary_crossentropy", "sparse_categorical_crossentropy",
...), a `_target_` node (`{_target_: keras.losses.SparseCategoricalCrossentropy, from_logits:
true}`) or a built Keras loss / callable `(y_true, y_pred) -> per-example values`, or, for a
model with dict outputs, a mapping output name -> one of those. One loss with dict outputs
applies to each output, and the outputs' losses are summed (as keras compile does).

What training pushes keeps MXNet's scale: `losses` gives one value per example and output (the
mean over the example's non-batch positions, e.g. the tokens of a sequence), the data-parallel
step sums them over its examples, and the optimizer's rescale_grad turns the sum into a mean.
The model's regularisation losses (`model.losses`, `regularization`) are added once per
update: n examples add n times their sum, so after the 1/global-batch rescale they count once.

`metrics` is a list of Keras names or `_target_` nodes (Keras metric objects, or functions that
are averaged over examples), applied to every output, or a mapping output name -> such a list.
'accuracy' / 'acc' map from the loss as keras compile maps them from shapes: sparse categorical
crossentropy -> SparseCategoricalAccuracy, categorical -> CategoricalAccuracy, binary ->
BinaryAccuracy (threshold 0 when the loss takes logits). A model with dict outputs reports
`<output>_<metric>` and `<output>_loss` for each output. Nothing here creates TensorFlow state
until `new_metrics` (config validation builds a Criterion before the CPU is split into devices).
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any, Callable, Mapping, Sequence

from tfkv.errors import ConfigError

ACCURACY = ("accuracy", "acc")
# (loss function name) -> the accuracy metric keras compile would pick for it
_ACCURACY_FOR = {
    "sparse_categorical_crossentropy": "SparseCategoricalAccuracy",
    "categorical_crossentropy": "CategoricalAccuracy",
    "binary_crossentropy": "BinaryAccuracy",
}
_LOSS_EXAMPLES = "mse, mae, huber, binary_crossentropy, categorical_crossentropy, sparse_categorical_crossentropy"


class Criterion:
    """The loss and the metric definitions of a run; `new_metrics` gives a fresh set per phase."""

    def __init__(self, loss: Any = None, metrics: Sequence[Any] | None = ("accuracy",)) -> None:
        """`loss`: as the module docstring says; None is sparse categorical crossentropy on logits
        (what tfkv's built-in classifiers output). `metrics`: a list of names / nodes / objects."""
        self.per_output = isinstance(loss, Mapping) and "_target_" not in loss
        items = dict(loss).items() if self.per_output else [(None, loss)]
        if self.per_output and not items:
            raise ConfigError("loss: the mapping names no output; give {output_name: loss, ...} or one loss")
        # None: the default, built at its first use, so that checking a default config never
        # imports TensorFlow (what it is, is known: see _kind)
        self._losses: dict[str | None, Any] = {
            name: None if spec is None else _loss(spec, "loss" if name is None else f"loss.{name}")
            for name, spec in items}
        if metrics is None:  # the config's default: accuracy where the loss says which one, else none
            metrics = ["accuracy"] if all(_ACCURACY_FOR.get(self._kind(o)[0]) for o in self._losses) else []
        self.metrics_per_output = isinstance(metrics, Mapping) and "_target_" not in metrics
        self._metric_specs = ({name: _listed(specs) for name, specs in metrics.items()}
                              if self.metrics_per_output else {None: _listed(metrics)})
        stray = sorted(set(self._metric_specs) - set(self._losses)) if self.per_output else []
        if self.metrics_per_output and stray:
            raise ConfigError(f"metrics.{stray[0]}: the loss names outputs {sorted(self._losses)}, not {stray[0]!r}; "
                              "key metrics by the same output names as the loss")
        # Bad names fail now, not at the first step (and without TensorFlow state).
        self.metric_names([n for n in self._metric_specs if n is not None] or list(self._losses))

    @classmethod
    def from_config(cls, loss: Any, metrics: Any) -> Criterion:
        """From the config's `loss` and `metrics` nodes (OmegaConf containers or plain values)."""
        from omegaconf import DictConfig, ListConfig, OmegaConf

        def plain(node: Any) -> Any:
            return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node

        return cls(plain(loss), plain(metrics))

    # -- the loss ----------------------------------------------------------------------------------

    def output_names(self, y: Any) -> list[str | None]:
        """The outputs labels `y` describe: their keys for dict labels, else [None]."""
        if isinstance(y, Mapping):
            names = sorted(y)
            if self.per_output and set(names) != set(self._losses):
                raise ConfigError(f"loss names outputs {sorted(self._losses)}, the labels have {names}; "
                                  "give one loss per output (loss.<output>=...) or a single loss for all")
            if self.metrics_per_output and not set(self._metric_specs) <= set(names):
                raise ConfigError(f"metrics names outputs {sorted(self._metric_specs)}, the labels have {names}; "
                                  "key metrics by the model's output names")
            return names
        for what, per_output, named in (("loss", self.per_output, self._losses),
                                        ("metrics", self.metrics_per_output, self._metric_specs)):
            if per_output:
                raise ConfigError(f"{what} names outputs {sorted(named)} but the model has one output; "
                                  f"give {what} for all outputs (loss=mse, metrics=[mae])")
        return [None]

    def losses(self, y: Any, pred: Any) -> dict[str | None, Any]:
        """Traceable: per output, one float32 loss per example (mean over its non-batch positions)."""
        import tensorflow as tf

        names = self.output_names(y)
        if names != [None] and not isinstance(pred, Mapping):
            raise ConfigError(f"the labels are a dict of outputs {names} but the model returns one "
                              f"{type(pred).__name__}; return a dict of outputs with those names")
        if names != [None] and set(pred) != set(names):
            raise ConfigError(f"the model's outputs {sorted(pred)} do not match the labels' {names}; "
                              "name the model's outputs as the data set names its labels")
        out = {}
        for name in names:
            yt, yp = (y, pred) if name is None else (y[name], pred[name])
            fn = self._loss_fn(name if self.per_output else None)
            key = "loss" if not self.per_output else f"loss.{name}"
            try:
                values = fn(yt, tf.cast(yp, tf.float32))
            except ValueError as e:  # raised while tracing: shapes that cannot fit
                raise ConfigError(f"{key}: {_name(fn)} does not fit the model's output {_shape(yp)} and the "
                                  f"labels {_shape(yt)} ({str(e).splitlines()[0]}); choose a loss for this "
                                  "output, or change the model's last layer") from None
            values = tf.cast(values, tf.float32)
            if values.shape.rank == 0:
                raise ConfigError(f"{key}: {_name(fn)} returned one value for the whole batch; it must "
                                  "return one per example (a Keras loss, or a function without reduction)")
            if values.shape.rank > 1:  # an example's loss: the mean over its positions (tokens)
                values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
            out[name] = values
        return out

    def _loss_fn(self, output: str | None) -> Callable[[Any, Any], Any]:
        if self._losses[output] is None:
            # built directly, not through _target_: this first runs while a step is traced, and
            # AutoGraph would try (and warn) to convert importlib's functions
            import keras

            self._losses[output] = _loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True), "loss")
        return self._losses[output]

    def _kind(self, output: str | None) -> tuple[str, bool]:
        """The loss function's name and whether it takes logits."""
        fn = self._losses[output]
        if fn is None:  # the default
            return "sparse_categorical_crossentropy", True
        inner = getattr(fn, "fn", None)  # Keras's LossFunctionWrapper subclasses
        return getattr(inner, "__name__", ""), bool(getattr(fn, "_fn_kwargs", {}).get("from_logits", False))

    def perplexity(self, y: Any) -> bool:
        """Whether exp(mean loss) is a perplexity: sequence labels (a time axis) of one output
        with a crossentropy loss."""
        if self.per_output or isinstance(y, Mapping):
            return False
        fn, _ = self._kind(None)
        rank = len(y.shape)
        return (fn == "sparse_categorical_crossentropy" and rank >= 2) or (fn == "categorical_crossentropy"
                                                                          and rank >= 3)

    # -- metrics -----------------------------------------------------------------------------------

    def value_names(self) -> list[str]:
        """What the run will report, as far as the config tells (no TensorFlow state): `loss`,
        and for the outputs the loss or metrics name, `<output>_loss`; every metric's name. With
        one loss and one metrics list the outputs are known only from the labels: then the
        names are those of a single output (a dict-output model adds `<output>_` to them)."""
        outputs = (list(self._losses) if self.per_output else
                   [n for n in self._metric_specs if n is not None] or [None])
        return ["loss", *(f"{o}_loss" for o in outputs if o is not None), *self.metric_names(outputs)]

    def metric_names(self, outputs: Sequence[str | None]) -> list[str]:
        """The names the metrics report for outputs `outputs` ([None]: one output), without
        building them: no TensorFlow state, so config validation may ask before devices exist."""
        return [reported for reported, _, _, _ in self._plan(outputs)]

    def new_metrics(self, outputs: Sequence[str | None]) -> list[tuple[str, str | None, Any]]:
        """Fresh Keras metric objects for outputs `outputs`: (reported name, output, metric)."""
        return [(reported, output, self._build(spec, output, key))
                for reported, output, spec, key in self._plan(outputs)]

    def _plan(self, outputs: Sequence[str | None]) -> list[tuple[str, str | None, Any, str]]:
        """(reported name, output, spec, config key) of every metric, checked."""
        planned = []
        for output in outputs:
            group = output if self.metrics_per_output else None
            for i, spec in enumerate(self._metric_specs.get(group, [])):
                key = _metric_key(group, i)
                name = self._metric_name(spec, output, key)
                planned.append((name if output is None else f"{output}_{name}", output, spec, key))
        reported = [p[0] for p in planned]
        if len(set(reported)) != len(reported):
            raise ConfigError(f"metrics: two metrics report the same name ({', '.join(reported)}); "
                              "list each metric once")
        return planned

    def _metric_name(self, spec: Any, output: str | None, key: str) -> str:
        """The name `spec` reports (as keras compile names it), after checking that it builds."""
        if isinstance(spec, str):
            if spec.lower() in ACCURACY:
                self._accuracy(spec, output, key)
            elif spec not in _keras_metric_names():
                raise ConfigError(f"{key}={spec!r} is not a Keras metric; use a name such as accuracy, mae, mse, "
                                  "auc, binary_accuracy, or a _target_ node (metrics=[{_target_: "
                                  "keras.metrics.AUC}])")
            return spec  # the name asked for is the name reported, as keras compile does
        if isinstance(spec, Mapping):
            from tfkv import target

            fn = target.check(spec, key)
            if spec.get("name"):
                return str(spec["name"])
            named, _ = target.parameters(fn)
            default = named["name"].default if "name" in named else None
            return default if isinstance(default, str) else _snake(getattr(fn, "__name__", "metric"))
        if callable(spec):  # a Keras metric object, or a function
            return _name(spec)
        raise ConfigError(f"{key} gives a {type(spec).__name__}, not a Keras metric or a function "
                          "(y_true, y_pred) -> values")

    def _accuracy(self, spec: str, output: str | None, key: str) -> tuple[str, dict[str, Any]]:
        """'accuracy' for the output's loss: (Keras metric class name, its arguments)."""
        output = output if self.per_output else None
        fn_name, from_logits = self._kind(output)
        cls_name = _ACCURACY_FOR.get(fn_name)
        if cls_name is None:
            raise ConfigError(f"{key}: {spec!r} needs a crossentropy loss to say which accuracy, and the loss "
                              f"is {_name(self._losses[output])}; name the metric: binary_accuracy, categorical_accuracy or "
                              "sparse_categorical_accuracy (or use mae, mse, ... for regression)")
        kwargs: dict[str, Any] = {"name": spec}
        if cls_name == "BinaryAccuracy" and from_logits:
            kwargs["threshold"] = 0.0  # a logit above 0 is a probability above 0.5
        return cls_name, kwargs

    def _build(self, spec: Any, output: str | None, key: str) -> Any:
        import keras

        if isinstance(spec, str) and spec.lower() in ACCURACY:
            cls_name, kwargs = self._accuracy(spec, output, key)
            return getattr(keras.metrics, cls_name)(**kwargs)
        if isinstance(spec, str):
            metric = keras.metrics.get(spec)
        elif isinstance(spec, Mapping):
            metric = _instantiate(spec, key)
        elif isinstance(spec, keras.metrics.Metric):
            metric = type(spec).from_config(spec.get_config())  # a fresh state for every phase
        else:
            metric = spec
        if isinstance(metric, keras.metrics.Metric):
            return metric
        if not callable(metric):
            raise ConfigError(f"{key} gives a {type(metric).__name__}, not a Keras metric or a function "
                              "(y_true, y_pred) -> values")
        return keras.metrics.MeanMetricWrapper(metric, name=_name(metric))


def regularization(model: Any) -> Any:
    """Traceable: the sum of `model.losses` (kernel regularisers, add_loss), 0.0 if none."""
    import tensorflow as tf

    losses = [tf.cast(v, tf.float32) for v in model.losses]
    return tf.add_n(losses) if losses else tf.constant(0.0)


def perplexity(mean_token_loss: float) -> float:
    return math.exp(min(mean_token_loss, 700.0))  # exp overflows a float past ~709


# -- building losses -------------------------------------------------------------------------------

def _loss(spec: Any, key: str) -> Callable[[Any, Any], Any]:
    """A callable (y_true, y_pred) -> unreduced per-example values."""
    import keras
    from keras.src.losses.losses import LossFunctionWrapper  # what keras compile wraps functions in

    if isinstance(spec, str):
        try:
            spec = keras.losses.get(spec)
        except ValueError:
            raise ConfigError(f"{key}={spec!r} is not a Keras loss; use a name such as {_LOSS_EXAMPLES}, or a "
                              "_target_ node (loss={_target_: keras.losses.Huber, delta: 2.0})") from None
    elif isinstance(spec, Mapping):
        spec = _instantiate(spec, key)
    if isinstance(spec, keras.losses.Loss):
        spec = copy.copy(spec)  # the caller's object keeps its reduction
        spec.reduction = None
        return spec
    if callable(spec):
        # Keras functions such as mean_squared_error: the wrapper gives y_true and y_pred one rank
        # first ((b,) labels with (b, 1) outputs would otherwise broadcast to (b, b)).
        return LossFunctionWrapper(spec, reduction=None, name=_name(spec))
    raise ConfigError(f"{key} gives a {type(spec).__name__}, not a Keras loss or a function (y_true, y_pred)")


def _instantiate(node: Mapping[str, Any], key: str) -> Any:
    from tfkv import target

    try:
        return target.call(node, key)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's class refused its arguments
        raise ConfigError(f"{key}: {node.get('_target_')} failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None


def _listed(specs: Any) -> list[Any]:
    if specs is None:
        return []
    if isinstance(specs, (str, Mapping)) or not isinstance(specs, Sequence):
        return [specs]  # one metric given on its own
    return list(specs)


def _metric_key(output: str | None, i: int) -> str:
    return f"metrics[{i}]" if output is None else f"metrics.{output}[{i}]"


def _keras_metric_names() -> Any:
    from keras.src.metrics import ALL_OBJECTS_DICT  # what keras.metrics.get looks names up in

    return ALL_OBJECTS_DICT


def _snake(name: str) -> str:
    """Keras's default object name for a class: RootMeanSquaredError -> root_mean_squared_error."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _name(fn: Any) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _shape(t: Any) -> str:
    return str(tuple(t.shape))
