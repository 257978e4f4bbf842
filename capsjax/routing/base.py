"""The routing registry: one signature for every algorithm, its capabilities, `route`,
and the options a config may set."""
import dataclasses
import functools
import inspect
import numbers
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from capsjax.errors import ArgumentError, ConfigError
from capsjax.keys import Key, annotated_keys, argument_problems
from capsjax.registry import Registry
from capsjax.routing.core import Array, check_flags, check_prediction_vectors


# ============================================================================= the registry
# Every routing algorithm has one signature:
#   function(prediction_vectors [batch, in, out, dim], input_activations [batch, in],
#            [routing_iterations, *, max_iterations=None, unroll=False,]   (iterative ones only)
#            **options) → RoutingResult
# and is registered with `@register_routing(name, ...)`, whose capabilities are:
#   iterative        whether it loops: only then does it take routing_iterations, max_iterations
#                    and unroll (route and the capsule layer pass them to no other)
#   learned          option → (shape from (in_caps, out_caps, dim), initial value): what a
#                    model learns; `route` fills each one it is not given with its initial value
#   returns_logits   accepts return_logits=True and then fills RoutingResult.logits, the
#                    routing logits after every iteration [iterations, batch, in, out] (the
#                    convergence probe and figure read them)
#   returns_couplings accepts return_couplings=True and then fills RoutingResult.couplings,
#                    the pair (couplings the first iteration used, couplings the last one
#                    used), each [batch, in, out], a distribution over the parents per child
#                    (the routing diagnostics read them; equal for a routing without iterations)
#   layer_inputs     which of the capsule layer's inputs (LAYER_INPUTS) it reads, passed as
#                    keyword arguments of the same names when the model's routing_inputs
#                    name them: 'bias' ([out, dim], added to s_j), 'log_priors' ([in, out],
#                    initial logits), 'leaky' (bool), 'stop_gradient_predictions' (bool)
#   shared           for class-capsule transforms shared over positions (one W per primary
#                    type and class, û_{j|i} = W_{t(i)j} u_i + the position offset of i): the
#                    same routing written without û, `shared(capsules [batch, positions,
#                    types, in_dim], transforms [types, out, dim, in_dim], offsets
#                    [positions, dim], [loop arguments as above,] **options)`
#                    → as the routing; None: the layer materialises û (see shared_votes)
#   per_capsule      for the paper's per-capsule transforms (û_{j|i} = W_ij u_i): the same
#                    routing written without û, `per_capsule(weights [in, out, dim, in_dim],
#                    capsules [batch, in, in_dim], routing_iterations (an int), **options)`
#                    → parents [batch, out, dim], which the layer calls in its place
#                    (model.formulation.prediction_vectors 'factored')
# Every other keyword argument with a default is an option a config may set, in the
# routing's own section (config.model.routing_options.NAME.OPTION). Activations are what
# the margin loss, the explorer and predict read.


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['parents', 'activations', 'couplings', 'logits'], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RoutingResult:
  """What every routing returns, by name: `parents` and `activations` (every routing has
  them); `couplings` and `logits`, None where the routing has none or was not asked for
  them.

  Example:
    >>> votes = jnp.ones((1, 4, 2, 3))                              # û [batch, in, out, dim]
    >>> result = capsjax.route('dynamic', votes, routing_iterations=2, return_couplings=True)
    >>> result.parents.shape, result.activations.shape              # [batch, out, dim], [batch, out]
    ((1, 2, 3), (1, 2))
    >>> result.couplings[0].shape, result.logits is None            # (first, last) [batch, in, out]
    ((1, 4, 2), True)
  """
  parents: Array                                   # v_j [batch, out, dim]
  activations: Array                               # a_j [batch, out], in [0, 1]
  couplings: Optional[Tuple[Array, Array]] = None  # (first, last) c_ij [batch, in, out]
  logits: Optional[Array] = None                   # b_ij after each iteration [iterations, batch, in, out]

  def __iter__(self):
    raise ArgumentError('a RoutingResult is read by name, result.parents and result.activations '
                        '(`parents, activations = route(...)` was the earlier API)')


def as_result(output, expected: Optional[Tuple[int, int, int]] = None, what: str = 'a routing') -> RoutingResult:
  """A routing's output as a RoutingResult: the RoutingResult itself, or the plain
  (parents, activations) pair a routing of one's own may return (`route` applies this to
  every routing it calls). Anything else (one array, three values: couplings and logits go
  into RoutingResult by name), or parents and activations not [batch, out, dim] and [batch,
  out] (`expected`: (batch, out, dim)), is a ValueError naming the shapes, at trace time."""
  is_pair = isinstance(output, (tuple, list)) and len(output) == 2
  if not isinstance(output, RoutingResult) and not is_pair:
    shape = getattr(output, 'shape', None)
    got = (f'one array of shape {tuple(shape)}' if shape else f'{len(output)} values'
           if isinstance(output, (tuple, list)) else type(output).__name__)
    raise ArgumentError(f'{what} returned {got}: a routing returns a RoutingResult (couplings and logits by name) '
                        'or the pair (parents [batch, out, dim], activations [batch, out])')
  result = output if isinstance(output, RoutingResult) else RoutingResult(*output)
  if expected is not None and (tuple(result.parents.shape) != expected
                               or tuple(result.activations.shape) != expected[:2]):
    raise ArgumentError(f'{what} returned parents {tuple(result.parents.shape)} and activations '
                        f'{tuple(result.activations.shape)}; expected {expected} [batch, out, dim] and {expected[:2]} '
                        '[batch, out] for its votes')
  return result


ROUTINGS = Registry('routing', iterative=True, learned={}, returns_logits=False, returns_couplings=False,
                    layer_inputs=(), shared=None, per_capsule=None,
                    doc="""The routing algorithms by name (`config.model.routing`, `CapsuleLayer.routing`,
`route(name, ...)`): each entry's value is the routing function, û [batch, in, out, dim] →
RoutingResult (parents [batch, out, dim], activations [batch, out], …), and its capabilities say what it
does (`iterative`, `learned`, `returns_logits`, `layer_inputs`, `shared`, `per_capsule`). Add one with
`register_routing`.

Example:
  >>> capsjax.ROUTINGS.names()
  ('dynamic', 'em', 'self_attention', 'inverted_dot_product', 'self_routing', 'uniform', 'max_pooling', 'variational_bayes')
  >>> capsjax.ROUTINGS['dynamic'].returns_logits, capsjax.ROUTINGS['em'].learned.keys()
  (True, dict_keys(['beta_u', 'beta_a']))
""")
# The capsule layer's inputs a routing may read (its `layer_inputs`), each passed under
# this name when the model's `routing_inputs` names it (capsjax.layers.CapsuleLayer).
LAYER_INPUTS = ('bias', 'log_priors', 'leaky', 'stop_gradient_predictions')
# The routing's own arguments: neither options nor learned.
_OWN_ARGUMENTS = ('prediction_vectors', 'input_activations', 'routing_iterations', 'max_iterations', 'unroll',
                  'return_logits', 'return_couplings')


def register_routing(name: str, *, iterative: bool = True,
                     learned: Optional[Dict[str, Tuple[Callable[[int, int, int], tuple], float]]] = None,
                     returns_logits: bool = False, returns_couplings: bool = False,
                     layer_inputs: Tuple[str, ...] = (), shared: Optional[Callable[..., Any]] = None,
                     per_capsule: Optional[Callable[..., Any]] = None):
  """Function decorator: `config.model.routing = name` routes with this function.

  The function takes prediction_vectors û [batch, in_caps, out_caps, dim] and
  input_activations [batch, in_caps]; an `iterative` one also routing_iterations and the
  keywords max_iterations and unroll (its loop: `capsjax.routing.iterate`). Options of its
  own, each with a default, its section of `config.model.routing_options` may set
  (`config.model.routing_options.NAME.OPTION`); `learned` ones become
  parameters of the capsule layer. It returns a RoutingResult, or the plain pair (parents
  [batch, out_caps, dim], activations [batch, out_caps]); the registry keeps the function
  as written (ROUTINGS[name].value) and `route` hands it the loop's arguments only if it
  is `iterative`. An iterative one without routing_iterations, or one that does not loop but
  declares the loop's arguments, is refused here, in one line (ConfigError). `returns_logits`: it
  accepts return_logits=True and then fills the logits per iteration; `returns_couplings`:
  it accepts return_couplings=True and then fills the (first, last) couplings [batch, in,
  out] (the routing diagnostics); `layer_inputs`: which of the capsule layer's inputs
  (LAYER_INPUTS: bias, log_priors, leaky, stop_gradient_predictions) it reads; `shared` and
  `per_capsule`: forms that route shared-transform or per-capsule votes without û (see the
  module's comment above ROUTINGS).

  Example:
    Uniform coupling: every child sends its vote to every parent equally.

    >>> @capsjax.register_routing('uniform_example', iterative=False)
    ... def uniform(prediction_vectors, input_activations):
    ...   parents = capsjax.squash(prediction_vectors.mean(axis=1))   # [batch, out, dim]
    ...   return parents, capsjax.vector_norm(parents)
    >>> capsjax.route('uniform_example', jnp.ones((1, 4, 2, 3))).activations   # |squash(1, 1, 1)| = 3 / 4
    Array([[0.75, 0.75]], dtype=float32)
    >>> capsjax.ROUTINGS.unregister('uniform_example')
  """
  unknown = sorted(set(layer_inputs) - set(LAYER_INPUTS))
  if unknown:
    raise ConfigError(f'register_routing({name!r}): layer_inputs {unknown} are not inputs of the capsule layer '
                      f'(allowed: {", ".join(LAYER_INPUTS)})')
  if not isinstance(iterative, bool):
    raise ArgumentError(f'register_routing({name!r}): iterative is True or False, got {iterative!r}')
  for option, declared in (learned or {}).items():   # each (shape of (in, out, dim), initial value)
    if not (isinstance(declared, tuple) and len(declared) == 2 and callable(declared[0])
            and isinstance(declared[1], numbers.Real)):
      raise ArgumentError(f'register_routing({name!r}): learned[{option!r}] is (a function of (in_caps, out_caps, '
                          f'dim) giving its shape, its initial value), got {declared!r}')

  def register(function):
    _check_loop_arguments(name, function, iterative)   # refused here: nothing registered, nothing warned
    for form, what in ((shared, "'s shared form"), (per_capsule, "'s per-capsule form")):
      if form is not None:
        _check_loop_arguments(name, form, iterative, what)
    _warn_if_replacing_a_built_in(name, function)
    ROUTINGS.register(name, function, iterative=iterative, learned=dict(learned or {}),
                      returns_logits=returns_logits, returns_couplings=returns_couplings,
                      layer_inputs=tuple(layer_inputs), shared=shared, per_capsule=per_capsule)
    return function
  return register


def _warn_if_replacing_a_built_in(name: str, function: Callable[..., Any]) -> None:
  """A routing of capsjax's own replaced by another function (not its module imported
  again): every model of the process, the paper's included, would route with it."""
  if name not in ROUTINGS:
    return
  built_in = ROUTINGS[name].value
  module = getattr(built_in, '__module__', '') or ''
  same = (module, getattr(built_in, '__qualname__', None)) == (function.__module__, function.__qualname__)
  if module.startswith('capsjax.') and not same:
    warnings.warn(f'register_routing({name!r}) replaces capsjax\'s built-in routing {name!r} for this process '
                  f'(config.model.routing={name!r} now runs {function.__module__}.{function.__qualname__}); '
                  'register it under a name of its own to keep both', stacklevel=3)


_LOOP_ARGUMENTS = ('routing_iterations', 'max_iterations', 'unroll')


def _check_loop_arguments(name: str, function: Callable[..., Any], iterative: bool, form: str = '') -> None:
  """An iterative routing takes the loop's arguments and a routing that does not loop takes
  none (it is handed none): refused here, in one line, otherwise."""
  parameters = inspect.signature(function).parameters
  what = f'routing {name!r}{form}'
  if 'num_iterations' in parameters:   # r's name before 0.4
    raise ConfigError(f'{what} takes num_iterations: r is called routing_iterations everywhere in capsjax (the '
                      'config key, the layer, route); rename the argument')
  if iterative and 'routing_iterations' not in parameters:
    raise ConfigError(f'{what} is registered iterative=True but takes no routing_iterations: give it the '
                      'arguments (…, routing_iterations, *, max_iterations=None, unroll=False) and loop with '
                      'capsjax.routing.iterate, or register it with iterative=False')
  declared = [argument for argument in _LOOP_ARGUMENTS if argument in parameters]
  if not iterative and declared:
    raise ConfigError(f'{what} is registered iterative=False but takes {", ".join(declared)}: a routing that does '
                      'not loop is handed no loop arguments (remove them), or register it with iterative=True')


def call(name: str, inputs: tuple, routing_iterations, max_iterations=None, unroll: bool = False, *,
         shared: bool = False, **options) -> RoutingResult:
  """Routing `name`'s registered function (`shared`: its shared form, inputs (capsules,
  transforms, offsets); else inputs (û, input activations)) called with the loop's arguments
  if it iterates, and `options`; its output checked (`as_result`)."""
  check_flags(f'route({name!r})', unroll=unroll)
  entry = ROUTINGS[name]
  function = entry.shared if shared else entry.value
  loop = {'max_iterations': max_iterations, 'unroll': unroll} if entry.iterative else {}
  output = function(*inputs, *((routing_iterations,) if entry.iterative else ()), **loop, **options)
  if shared:   # capsules [batch, pos, types, in_dim], transforms [types, out, dim, in_dim]
    expected = (inputs[0].shape[0],) + tuple(inputs[1].shape[1:3])
  else:        # û [batch, in, out, dim]
    expected = (inputs[0].shape[0],) + tuple(inputs[0].shape[2:])
  return as_result(output, expected, f'routing {name!r}' + ("'s shared form" if shared else ''))


def shared_form(name: str, options: Dict[str, Any], votes: str = 'shared') -> Optional[Callable[..., Any]]:
  """Routing `name` written without û for shared transforms (its registered `shared`; with
  votes='per_capsule' its `per_capsule` form), if it has one that takes every option in
  `options`; else None (the layer then materialises û). Procedure 1's take the bias but not
  the per-capsule features (log priors per input capsule, leaky routing, stopped-gradient
  votes), nor return_logits."""
  form = getattr(ROUTINGS[name], votes)
  if form is None:
    return None
  accepted = inspect.signature(form).parameters
  return form if all(option in accepted for option in options) else None


def route(name: str, prediction_vectors: Array, input_activations: Optional[Array] = None,
          routing_iterations: Union[int, Array] = 3, *, max_iterations: Optional[int] = None,
          unroll: bool = False, **options) -> RoutingResult:
  """RoutingResult (parents [batch, out, dim], activations [batch, out], …) of routing `name`.

  prediction_vectors û [batch, in, out, dim]; input_activations [batch, in] (default ones;
  Procedure 1 ignores them); routing_iterations a Python int or, with `max_iterations=`, a
  traced integer (vmap over r, with gradients); the loop arguments reach iterative
  routings only. Learned options not given take their initial values.

  Example:
    >>> votes = jax.random.normal(jax.random.key(0), (2, 6, 3, 4))   # û [batch, in, out, dim]
    >>> for name in ('dynamic', 'em'):
    ...   routed = capsjax.route(name, votes, routing_iterations=2)
    ...   print(name, routed.parents.shape, routed.activations.shape)
    dynamic (2, 3, 4) (2, 3)
    em (2, 3, 4) (2, 3)
  """
  entry = ROUTINGS[name]
  problems = option_value_problems(name, options, f'route({name!r}): ')
  if problems:
    raise ConfigError(problems[0])
  check_prediction_vectors(prediction_vectors, f'route({name!r})')
  prediction_vectors = jnp.asarray(prediction_vectors)   # NumPy's float64 → JAX's float (no x64: float32)
  batch, in_caps, out_caps, dim = prediction_vectors.shape
  if input_activations is None:
    input_activations = jnp.ones((batch, in_caps), prediction_vectors.dtype)
  elif tuple(input_activations.shape) != (batch, in_caps):
    raise ArgumentError(f'route: input_activations {tuple(input_activations.shape)} do not match the votes '
                        f'{tuple(prediction_vectors.shape)}: expected [batch, in] = {(batch, in_caps)}')
  for option, (shape, initial) in entry.learned.items():
    if option not in options or options[option] is None:
      options[option] = jnp.full(shape(in_caps, out_caps, dim), initial, prediction_vectors.dtype)
  return call(name, (prediction_vectors, input_activations), routing_iterations, max_iterations, unroll, **options)


@functools.lru_cache(maxsize=None)
def _parameters(function) -> Tuple[inspect.Parameter, ...]:
  """`function`'s parameters, read once: validation and --help ask for each routing's
  options once per config key."""
  return tuple(inspect.signature(function).parameters.values())


def routing_option_defaults(name: str) -> Dict[str, Any]:
  """The options a config may set for routing `name` (keyword arguments that are neither
  learned, nor the loop's own, nor the capsule layer's features), with their defaults."""
  entry = ROUTINGS[name]
  return {p.name: p.default for p in _parameters(entry.value)
          if p.name not in _OWN_ARGUMENTS and p.name not in entry.learned and p.name not in entry.layer_inputs}


def routing_option_keys(name: str) -> Dict[str, Key]:
  """Routing `name`'s options as config keys: each keyword argument's default, and its rule
  and help where its signature annotates them (`Annotated[float, keys.About(rule, help)]`;
  a routing written without annotations still has its options, with any value allowed)."""
  declared = annotated_keys(ROUTINGS[name].value)
  return {option: declared.get(option, Key(option, default, None, f'an option of routing {name!r}'))
          for option, default in routing_option_defaults(name).items()}


def option_value_problems(name: str, options, prefix: str) -> List[str]:
  """Each of routing `name`'s configurable options in `options` given as a Python value that
  its rule refuses, one line each (`{prefix}OPTION=VALUE: allowed …`, the config's words);
  arrays (a traced option, one vmapped over) pass: they cannot be read here."""
  keys = routing_option_keys(name)
  return argument_problems({option: (value, keys[option].rule) for option, value in options.items() if option in keys},
                           prefix)


def own_section_problems(name: str, sections, where: str = 'config.model.routing_options') -> List[str]:
  """The lines of what is wrong with `sections` (routing_options: a section per routing,
  {'em': {'inverse_temperature': 2.0}}) for `routing=name`, one shape everywhere (the
  config, `build_model`, CapsNet, CapsuleLayer): not a dict of sections (a bare option,
  the layout before sections, names its section), or an option routing `name` does not
  take in its own section. Other routings' sections are not read here."""
  if not hasattr(sections, 'items'):
    return [f'{where}={sections!r}: allowed a dict: routing name → its options']
  problems = []
  own = routing_option_defaults(name)
  inputs = ROUTINGS[name].layer_inputs
  takes = (f'the options {", ".join(own)}' if own else 'no options'
           + (f' (its inputs from the layer: model.routing_inputs, of {", ".join(inputs)})' if inputs else ''))
  for section, options in dict(sections).items():
    if not hasattr(options, 'items'):
      owners = [other for other in ROUTINGS if section in routing_option_defaults(other)]
      problems.append(f'{where}.{section}={options!r}: options are per routing, '
                      + (f'e.g. routing_options.{owners[0]}.{section}' if owners else f'routing {name!r} has {takes}'))
    elif section == name:
      problems.extend(f'{where}.{section}.{option}={value!r}: routing {name!r} has {takes}'
                      for option, value in options.items() if option not in own)
      problems.extend(option_value_problems(name, options, f'{where}.{section}.'))
  return problems


def own_routing_options(name: str, sections) -> Dict[str, Any]:
  """Routing `name`'s options from `sections` (a section per routing; None: none): its own
  section, checked (ConfigError naming the option and what the routing takes); the other
  sections are other routings' and are not read."""
  problems = own_section_problems(name, sections if sections is not None else {}, 'routing_options')
  if problems:
    raise ConfigError(problems[0])
  return dict((sections or {}).get(name) or {})


def configurable_routing_options() -> Dict[str, Dict[str, Any]]:
  """Every registered routing's options at their defaults, a section per routing that has
  options: what config.model.routing_options holds (`--config.model.routing_options.em.
  inverse_temperature=2`); two routings' options of one name cannot collide."""
  sections = {}
  for name in ROUTINGS:
    own = routing_option_defaults(name)
    if own:
      sections[name] = own
  return sections
