"""CapsNet: exact parameter counts, conv formulations, masking, input checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import ops
from capsjax.formulations import Formulation
from capsjax.models import CapsNet, build_model, count_params
from capsjax.experiments import mnist

# Compares formulations / the model's own answers at float32 tolerances (see conftest).
# Compiling many small programs is this module's time: XLA's cheap compilation (conftest.py).
pytestmark = [pytest.mark.float32_matmuls, pytest.mark.compile_bound]


def _param_shapes(model, input_shape=(28, 28, 1)):
  dummy = jnp.zeros((1,) + input_shape)
  return jax.eval_shape(lambda: model.init(jax.random.key(0), dummy))['params']


def test_paper_parameter_counts():
  # conv1 9*9*256+256, primary 9*9*256*256+256, W 1152*10*16*8, decoder 160-512-1024-784.
  model = build_model(**mnist.get_model_config())
  assert count_params(_param_shapes(model)) == 8_215_568
  no_decoder = CapsNet(use_decoder=False)
  assert count_params(_param_shapes(no_decoder)) == 6_804_224
  params = _param_shapes(model)
  assert params['digit_caps']['weights'].shape == (1152, 10, 16, 8)


def test_optional_parameters_add_exactly_their_size():
  base = count_params(_param_shapes(CapsNet(use_decoder=False)))
  with_bias = count_params(_param_shapes(CapsNet(use_decoder=False, routing_inputs=('bias',))))
  with_priors = count_params(_param_shapes(CapsNet(use_decoder=False, routing_inputs=('log_priors',))))
  assert with_bias - base == 10 * 16
  assert with_priors - base == 1152 * 10


def test_weights_drawn_as_matrices_are_flaxs_initializers_bit_for_bit():
  # The CapsNet's initializers and the layers' defaults draw a weight of rank 3 or more as a
  # matrix (XLA:CPU compiles that faster): the very numbers of Flax's initializer at the
  # weight's own shape, ranks 2 to 5 (the DigitCaps W_ij is rank 4, or 5 per type).
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  from capsjax import layers  # pylint: disable=g-import-not-at-top
  from capsjax.models import initializers  # pylint: disable=g-import-not-at-top
  lecun, tenth = nn.initializers.lecun_normal(), nn.initializers.truncated_normal(0.1)
  plain = {'default': {'conv1': lecun, 'primary': lecun, 'decoder': lecun, 'digit': nn.initializers.normal(0.01)},
           'official': {'conv1': nn.initializers.truncated_normal(0.05), 'primary': tenth, 'decoder': tenth,
                        'digit': tenth},
           'layers': {'Conv': lecun, 'PrimaryCaps': lecun, 'TransposedConv': lecun, 'CapsuleLayer': nn.initializers.normal(0.01)}}
  ours = {'default': initializers('default'), 'official': initializers('official'),
          'layers': {name: getattr(layers, name).__dataclass_fields__['weights_init' if name == 'CapsuleLayer' else 'kernel_init'].default
                     for name in plain['layers']}}
  shapes = ((6, 5), (3, 3, 2, 4), (2, 3, 2, 4, 2))

  @jax.jit   # one program for all the draws
  def draws(key):
    return {(scheme, part, shape): (ours[scheme][part](key, shape, jnp.float32), init(key, shape, jnp.float32))
            for scheme, parts in plain.items() for part, init in parts.items() for shape in shapes}
  for case, (drawn, flaxs) in draws(jax.random.key(7)).items():
    assert drawn.shape == case[2] and np.array_equal(np.asarray(drawn), np.asarray(flaxs)), case


# Odd sizes and strides that do not divide them (phases with zero rows), a kernel the
# stride does not divide (zero taps), a non-square image, a batch of 18 (kernel_rows
# works in chunks of 9 then, its backward in a scan).
@pytest.mark.parametrize('stride,height,width,kernel,batch', [(1, 12, 12, 5, 2), (2, 14, 13, 5, 18), (2, 13, 13, 3, 2),
                                                              (3, 11, 10, 4, 3)])
def test_conv_formulations_agree_in_value_and_gradient(stride, height, width, kernel, batch):
  images = jax.random.normal(jax.random.key(0), (batch, height, width, 3))
  weights = jax.random.normal(jax.random.key(1), (kernel, kernel, 3, 4))
  xla = ops.conv2d(images, weights, stride, 'xla')
  conv = lambda x, w, impl, extraction='auto': ops.conv2d(x, w, stride, impl, patch_extraction=extraction)
  loss = lambda x, w, *how: jnp.sum(jnp.sin(conv(x, w, *how)))
  g_xla = jax.grad(loss, argnums=(0, 1))(images, weights, 'xla')
  outputs = {}
  for how in (('patches', 'slices'), ('patches', 'gather'), ('kernel_rows',), ('fourier',), ('space_to_depth',)):
    outputs[how] = jax.jit(conv, static_argnums=(2, 3))(images, weights, *how)
    np.testing.assert_allclose(outputs[how], xla, rtol=1e-5, atol=2e-5, err_msg=str(how))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=tuple(range(2, 2 + len(how))))(images, weights, *how)
    for ours, theirs in zip(grads, g_xla):
      np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4, err_msg=str(how))
  # The two patch matrices are the same numbers in the same order: the same products.
  np.testing.assert_array_equal(outputs['patches', 'slices'], outputs['patches', 'gather'])


@pytest.mark.float32_matmuls
def test_prediction_vector_forms_agree_with_the_plain_product_in_value_and_derivatives():
  weights = jax.random.normal(jax.random.key(0), (6, 3, 4, 5))    # [in_caps, out_caps, out_dim, in_dim]
  capsules = jax.random.normal(jax.random.key(1), (2, 6, 5))      # [batch, in_caps, in_dim]
  plain = np.einsum('ijdk,bik->bijd', np.float64(weights), np.float64(capsules))   # û_{j|i} = W_ij u_i
  votes = jax.jit(ops.prediction_vectors, static_argnums=2)
  loss = lambda w, u, form: jnp.sum(jnp.sin(ops.prediction_vectors(w, u, form)))
  gradient = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
  tangents = (jnp.cos(weights), jnp.sin(capsules))
  forward = lambda form: jax.jvp(lambda w, u: ops.prediction_vectors(w, u, form), (weights, capsules), tangents)
  for form in ('einsum', 'multiply_adds'):
    np.testing.assert_allclose(votes(weights, capsules, form), plain, rtol=1e-5, atol=1e-5, err_msg=form)
    for ours, theirs in zip(gradient(weights, capsules, form), gradient(weights, capsules, 'einsum')):
      np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5, err_msg=form)
    for ours, theirs in zip(forward(form), forward('einsum')):
      np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5, err_msg=form)
  with pytest.raises(ValueError, match="prediction_vectors must be one of .* got 'nope'"):
    ops.prediction_vectors(weights, capsules, 'nope')
  # The paper's layer with 'factored' routes without û: the values and derivatives (both
  # modes) of Procedure 1 on û.
  from capsjax.layers import CapsuleLayer, Formulation  # pylint: disable=g-import-not-at-top
  layer = lambda form: CapsuleLayer(num_capsules=3, dim=4, routing_inputs=('bias',),
                                    formulation=Formulation(prediction_vectors=form))
  params = {'params': {'weights': weights, 'bias': jnp.cos(weights[0, :, :, 0])}}
  parents = lambda form: lambda p, u: layer(form).apply(p, u).parents
  np.testing.assert_allclose(jax.jit(parents('factored'))(params, capsules),
                             jax.jit(parents('einsum'))(params, capsules), rtol=1e-5, atol=1e-6)
  total = lambda form: lambda p, u: jnp.sum(jnp.sin(parents(form)(p, u)))
  for ours, theirs in zip(jax.tree.leaves(jax.jit(jax.grad(total('factored'), (0, 1)))(params, capsules)),
                          jax.tree.leaves(jax.jit(jax.grad(total('einsum'), (0, 1)))(params, capsules))):
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
  tangent = lambda form: jax.jvp(lambda u: parents(form)(params, u), (capsules,), (jnp.sin(capsules),))[1]
  np.testing.assert_allclose(tangent('factored'), tangent('einsum'), rtol=1e-4, atol=1e-6)
  # bfloat16 inputs: accumulated in float32, as the einsum does, and returned in bfloat16.
  halves = votes(weights.astype(jnp.bfloat16), capsules.astype(jnp.bfloat16), 'multiply_adds')
  assert halves.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.float32(halves), votes(_bf16(weights), _bf16(capsules), 'einsum'), rtol=1e-2)


def test_auto_picks_the_convolution_per_layer_by_the_rule():
  from capsjax import formulations  # pylint: disable=g-import-not-at-top
  layer = formulations.ConvLayer
  primary, conv1 = layer(20, 20, 256, 256, 9, 2), layer(28, 28, 1, 256, 9, 1)
  # Hand counts for PrimaryCaps: 6·6·81·256·256 direct; fourier on the 10×10 grid of 4 phases
  # (1024 channels), 48 complex bins and 4 real ones ((0|5, 0|5)) in 50 slots of two rows
  # (cos and sin; two real bins): 100 transform rows, four products per slot,
  # 100·100·1024 + 200·1024·256 + 200·36·256 + 100·25·1024·256/128.
  assert primary.direct_multiply_adds() == 6 * 6 * 81 * 256 * 256
  assert formulations.spectrum_bins(10, 10)[1] == ((0, 0), (5, 0), (0, 5), (5, 5))
  assert len(formulations.spectrum_bins(10, 10)[0]) == 48
  assert primary.fourier_multiply_adds() == 100 * 100 * 1024 + 200 * 1024 * 256 + 200 * 36 * 256 + 100 * 25 * 1024 * 2
  assert formulations.resolve('conv_impl', 'auto', 'cpu', primary) == 'fourier'
  assert formulations.resolve('conv_impl', 'auto', 'cpu', primary._replace(batch=64)) == 'fourier'
  assert formulations.resolve('conv_impl', 'auto', 'cpu', primary._replace(batch=32)) == 'kernel_rows'
  assert formulations.resolve('conv_impl', 'auto', 'cpu', primary._replace(batch=1)) == 'patches'   # the explorer
  assert formulations.resolve('conv_impl', 'auto', 'cpu', conv1) == 'patches'          # fourier: 10x the work
  assert formulations.resolve('conv_impl', 'auto', 'cpu', primary._replace(dot_inputs='bfloat16')) == 'kernel_rows'
  assert formulations.resolve('conv_impl', 'auto', 'cpu', layer(66, 66, 128, 128, 9, 1)) == 'kernel_rows'
  assert formulations.resolve('conv_impl', 'auto', 'gpu', primary) == 'space_to_depth'
  assert formulations.resolve('conv_impl', 'auto', 'gpu', conv1) == 'patches'
  assert formulations.resolve('conv_impl', 'kernel_rows', 'cpu', conv1) == 'kernel_rows'   # explicit stays
  # Patches without gradients: one matmul where the whole call's patch matrix is ≤ 32 MiB
  # (Conv1 at batch 128: 128·20·20·81·4 bytes, 15.8 MiB), chunks above (Conv1 at 512: 63.3
  # MiB; PrimaryCaps at 32: 91.1 MiB); explicit values stay, a GPU takes one matmul.
  assert conv1.patch_matrix_bytes() == 128 * 20 * 20 * 81 * 4
  assert formulations.resolve('patches_inference', 'auto', 'cpu', conv1) == 'whole_batch'
  assert formulations.resolve('patches_inference', 'auto', 'cpu', conv1._replace(batch=512)) == 'chunked'
  assert formulations.resolve('patches_inference', 'auto', 'cpu', primary._replace(batch=32)) == 'chunked'
  assert formulations.resolve('patches_inference', 'auto', 'cpu') == 'chunked'   # without a layer
  assert formulations.resolve('patches_inference', 'chunked', 'cpu', conv1) == 'chunked'
  assert formulations.resolve('patches_inference', 'auto', 'gpu', primary) == 'whole_batch'
  # XLA's convolutions in a vmapped ensemble: one per member in a GPU run's ensemble; vmap's
  # own elsewhere, for one model, and where a model is traced without a run's choice.
  chosen = lambda platform, ensemble: formulations.for_platform({'member_convs': 'auto'}, platform, ensemble).member_convs
  assert [chosen('gpu', True), chosen('gpu', False), chosen('cpu', True)] == ['per_member', 'grouped', 'grouped']
  assert formulations.resolve('member_convs', 'auto', 'gpu') == 'grouped'
  # The im2col patch matrix: one gather on a CPU (compiles faster), the slices the GPUs measured.
  assert [formulations.resolve('patch_extraction', 'auto', platform) for platform in ('cpu', 'gpu', 'tpu')] == [
      'gather', 'slices', 'slices']
  # û: none on a CPU (dynamic routing contracts W and u), the einsum the GPUs measured.
  assert [formulations.resolve('prediction_vectors', 'auto', platform) for platform in ('cpu', 'gpu', 'tpu')] == [
      'factored', 'einsum', 'einsum']
  with pytest.raises(ValueError, match="'fourier' computes in float32"):
    ops.conv2d(jnp.ones((1, 9, 9, 2)), jnp.ones((3, 3, 2, 2)), 2, 'fourier', dot_inputs='bfloat16')


def _bf16(array):
  return array.astype(jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize('impl,inference', [('patches', 'chunked'), ('patches', 'whole_batch'), ('kernel_rows', 'auto'),
                                            ('xla', 'auto')])
def test_bfloat16_conv_inputs_round_the_inputs_and_accumulate_in_float32(impl, inference):
  # The reference: float32 math on bfloat16-rounded images and kernel (the gradients: on
  # rounded patches and output gradient, as dW = Pᵀ g and dP = g Wᵀ see them). Values
  # near 1 with 72-term sums: a bfloat16 accumulator (8 bits) would miss by ~1e-1.
  images = 1 + 0.01 * jax.random.normal(jax.random.key(8), (4, 9, 9, 8))
  weights = 1 + 0.01 * jax.random.normal(jax.random.key(9), (3, 3, 8, 5))
  out = ops.conv2d(images, weights, 2, impl, inference, dot_inputs='bfloat16')
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, ops.conv2d(_bf16(images), _bf16(weights), 2, 'xla'), rtol=1e-5)
  assert np.abs(out - ops.conv2d(images, weights, 2, 'xla')).max() > 1e-3   # it did round

  cotangent = 1 + 0.01 * jax.random.normal(jax.random.key(10), out.shape)
  loss = lambda x, w, rounding: jnp.sum(ops.conv2d(x, w, 2, impl, inference, dot_inputs=rounding) * cotangent)
  g_images, g_weights = jax.grad(loss, argnums=(0, 1))(images, weights, 'bfloat16')
  assert g_images.dtype == g_weights.dtype == jnp.float32
  reference = lambda x, w: jnp.sum(ops.conv2d(x, w, 2, 'xla') * _bf16(cotangent))
  r_images, r_weights = jax.grad(reference, argnums=(0, 1))(_bf16(images), _bf16(weights))
  # XLA's convolution differentiates through the casts, so its gradients come out rounded
  # to bfloat16 as well (relative error < 2⁻⁷); the patches form keeps them in float32.
  tolerance = 2 ** -7 if impl == 'xla' else 1e-5
  np.testing.assert_allclose(g_images, r_images, rtol=tolerance)
  np.testing.assert_allclose(g_weights, r_weights, rtol=tolerance)
  with pytest.raises(ValueError, match='dot_inputs must be one of'):
    ops.conv2d(images, weights, 2, impl, dot_inputs='float16')


def test_capsnet_with_bfloat16_conv_inputs_stays_close_to_float32():
  # A 12×12 model (3×3 kernels): the same code path, a fraction of the compile time.
  small = dict(conv1_channels=16, conv1_kernel=3, primary_types=4, primary_kernel=3, input_shape=(12, 12, 1),
               decoder_hidden=(16,), use_decoder=True)
  images = jax.random.uniform(jax.random.key(11), (3, 12, 12, 1))
  # float32 compute on any backend (a GPU's 'auto' is bfloat16, which would round the inputs anyway).
  exact, rounded = (CapsNet(formulation=Formulation(conv_inputs=inputs, dtype='float32'), **small)
                    for inputs in ('float32', 'bfloat16'))
  params = jax.jit(exact.init)(jax.random.key(12), images)['params']
  out_exact = jax.jit(exact.apply)({'params': params}, images)
  out_rounded = jax.jit(rounded.apply)({'params': params}, images)
  assert out_rounded['lengths'].dtype == jnp.float32
  np.testing.assert_allclose(out_rounded['lengths'], out_exact['lengths'], rtol=3e-2, atol=1e-4)
  assert not np.array_equal(out_rounded['lengths'], out_exact['lengths'])


def _lengths_and_gradients(models, params, images) -> list:
  """Per model: (capsule lengths, the gradient of their sum) of `images`, one compiled
  program each (outputs and gradient apart took two)."""
  def loss(p, model):
    lengths = model.apply({'params': p}, images)['lengths']
    return jnp.sum(lengths), lengths

  outputs_and_gradient = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  return [(lengths, gradient) for (_, lengths), gradient in (outputs_and_gradient(params, m) for m in models)]


@pytest.mark.float32_matmuls
def test_bfloat16_compute_stays_close_to_float32_and_auto_picks_it_for_a_gpu():
  # model.dtype: convolutions and predictions in bfloat16; parameters, routing softmax,
  # squash, losses and gradients' accumulation in float32. Stated tolerance: capsule
  # lengths within 3 % (bfloat16 keeps 8 bits: ~0.4 % per rounding, over two convolutions
  # and the votes; measured 0.5 %), the gradient within 5 % of float32's norm (0.5 %).
  from capsjax import formulations  # pylint: disable=g-import-not-at-top
  small = dict(conv1_channels=16, conv1_kernel=3, primary_types=4, primary_kernel=3, input_shape=(12, 12, 1),
               decoder_hidden=(16,), use_decoder=True)
  images = jax.random.uniform(jax.random.key(13), (4, 12, 12, 1))
  exact, halved = (CapsNet(formulation=Formulation(conv_impl='xla', dtype=dtype), **small) for dtype in ('float32', 'bfloat16'))
  params = jax.jit(exact.init)(jax.random.key(14), images)['params']
  assert {leaf.dtype for leaf in jax.tree.leaves(jax.eval_shape(halved.init, jax.random.key(14), images)['params'])} == {
      jnp.dtype(jnp.float32)}
  (out_exact, g_exact), (out_halved, g_halved) = _lengths_and_gradients((exact, halved), params, images)
  assert out_halved.dtype == jnp.float32
  np.testing.assert_allclose(out_halved, out_exact, rtol=3e-2, atol=1e-7)
  assert not np.array_equal(out_halved, out_exact)
  g_exact, g_halved = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)]) for grads in (g_exact, g_halved))
  assert g_halved.dtype == jnp.float32
  assert float(jnp.linalg.norm(g_halved - g_exact)) <= 0.05 * float(jnp.linalg.norm(g_exact))
  # 'auto': the table entry of the platform the run is built for (assemble.model), on any
  # machine: a GPU's model traced here computes in bfloat16, a CPU's in float32.
  for platform, halves in (('cpu', False), ('gpu', True)):
    built = CapsNet(formulation=formulations.for_platform({'conv_impl': 'xla', 'dtype': 'auto'}, platform), **small)
    assert ('bf16' in str(jax.make_jaxpr(built.apply)({'params': params}, images))) == halves, platform


def test_capsnet_formulations_agree():
  small = dict(conv1_channels=16, primary_types=4, use_decoder=True)
  images = jax.random.uniform(jax.random.key(2), (3, 28, 28, 1))
  # float32 on any backend (a GPU's 'auto' is bfloat16): the tolerance is float32's.
  model_xla, model_patches = (CapsNet(formulation=Formulation(conv_impl=impl, dtype='float32'), **small)
                              for impl in ('xla', 'patches'))
  params = jax.jit(model_xla.init)(jax.random.key(3), images)['params']
  (out_xla, g_xla), (out_patches, g_patches) = _lengths_and_gradients((model_xla, model_patches), params, images)
  np.testing.assert_allclose(out_patches, out_xla, rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g_patches), jax.tree.leaves(g_xla)):
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)


def test_decoder_sees_only_the_masked_capsule():
  model = CapsNet(conv1_channels=16, primary_types=4)
  images = jax.random.uniform(jax.random.key(4), (2, 28, 28, 1))
  params = jax.jit(model.init)(jax.random.key(5), images)['params']
  apply = jax.jit(model.apply)   # compiled (once per mask or none): faster than op by op
  out = apply({'params': params}, images)
  assert out['capsules'].shape == (2, 10, 16) and out['reconstructions'].shape == (2, 28, 28, 1)
  assert np.all((out['lengths'] >= 0) & (out['lengths'] < 1))
  longest = jnp.argmax(out['lengths'], -1)
  by_longest = apply({'params': params}, images, mask=jax.nn.one_hot(longest, 10))
  np.testing.assert_allclose(by_longest['reconstructions'], out['reconstructions'], rtol=1e-5, atol=1e-7)
  other = jax.nn.one_hot((longest + 1) % 10, 10)
  by_other = apply({'params': params}, images, mask=other)
  assert not np.allclose(by_other['reconstructions'], out['reconstructions'])


def test_wrong_input_shape_is_a_clear_error():
  model = CapsNet(conv1_channels=8, primary_types=2)
  with pytest.raises(ValueError, match=r'expects images of shape \[batch, 28, 28, 1\]'):
    model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 1)))


@pytest.mark.float32_matmuls
def test_layers_compute_integer_and_numpy_float64_inputs_as_float32():
  # As Flax's layers promote them. An integer input once cast the weights to its integers
  # (all zeros: silently wrong outputs), and NumPy's float64 made JAX warn of truncation.
  import warnings  # pylint: disable=g-import-not-at-top
  from capsjax.layers import CapsuleLayer, PrimaryCaps  # pylint: disable=g-import-not-at-top
  counts = np.random.default_rng(0).integers(0, 4, (2, 7, 7, 3))   # [batch, height, width, channels]
  for layer, inputs in ((PrimaryCaps(num_types=2, dim=4, kernel_size=3), counts),
                        (CapsuleLayer(num_capsules=3, dim=4), counts.reshape(2, 49, 3))):
    variables = jax.jit(layer.init)(jax.random.key(0), jnp.asarray(inputs, jnp.float32))
    expected = jax.tree.leaves(layer.apply(variables, jnp.asarray(inputs, jnp.float32)))[0]
    assert float(jnp.abs(expected).max()) > 1e-5
    for given in (inputs.astype(np.int32), inputs.astype(np.float64)):
      with warnings.catch_warnings():
        warnings.simplefilter('error')
        got = jax.tree.leaves(layer.apply(variables, given))[0]
      assert got.dtype == jnp.float32
      np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_chunked_patch_convolution_covers_the_whole_batch():
  assert ops.batch_chunk_size(128, 16) == 16 and ops.batch_chunk_size(20, 16) == 10
  assert ops.batch_chunk_size(7, 16) == 7 and ops.batch_chunk_size(17, 16) == 1
  images = jax.random.normal(jax.random.key(6), (20, 11, 11, 2))  # two chunks of 10
  weights = jax.random.normal(jax.random.key(7), (3, 3, 2, 5))
  reference = ops.conv2d(images, weights, 2, 'xla')
  for patches_inference in ('chunked', 'whole_batch'):   # lax.map over chunks, or one matmul
    np.testing.assert_allclose(ops.conv2d(images, weights, 2, 'patches', patches_inference),
                               reference, rtol=1e-5, atol=1e-5)


@pytest.mark.float32_matmuls
def test_add_bias_has_the_values_and_gradients_of_the_plain_sum():
  # Its bias gradient is a matrix-vector product (not XLA's strided tree of sums): the same
  # numbers, for mixed dtypes (each cotangent in its own dtype), under vmap, and for no rows.
  outputs = jax.random.normal(jax.random.key(8), (3, 4, 5, 6))
  bias = jax.random.normal(jax.random.key(9), (6,))
  weights = jax.random.normal(jax.random.key(10), outputs.shape)
  loss = lambda add: lambda o, b: jnp.sum(weights[:o.shape[0]] * jnp.tanh(add(o, b)))
  plain = lambda o, b: o + b
  for o, b in ((outputs, bias), (outputs, bias.astype(jnp.bfloat16)), (outputs.astype(jnp.bfloat16), bias),
               (outputs[:0], bias)):
    np.testing.assert_array_equal(ops.add_bias(o, b), plain(o, b))
    got, expected = (jax.jit(jax.grad(loss(add), argnums=(0, 1)))(o, b) for add in (ops.add_bias, plain))
    for g, e, primal in zip(got, expected, (o, b)):
      assert g.dtype == primal.dtype and g.shape == primal.shape
      np.testing.assert_allclose(np.float32(g), np.float32(e), rtol=1e-2 if e.dtype == jnp.bfloat16 else 1e-5,
                                 atol=1e-5)
  members = jnp.stack([bias, 2 * bias])                                      # [members, features]
  got = jax.grad(lambda m: jnp.sum(jax.vmap(lambda b: jnp.tanh(ops.add_bias(outputs, b)))(m) ** 2))(members)
  expected = jax.grad(lambda m: jnp.sum(jax.vmap(lambda b: jnp.tanh(outputs + b))(m) ** 2))(members)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('kernel', [5, 4])
def test_same_padding_conv_equals_flax_conv(kernel):
  # The CNN baselines use capsjax's Conv with SAME padding so that the fast CPU
  # formulation applies to them too; it must equal flax's own SAME convolution.
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from capsjax.layers import Conv, Formulation  # pylint: disable=g-import-not-at-top
  images = jax.random.normal(jax.random.key(4), (2, 11, 11, 3))
  reference = nn.Conv(6, (kernel, kernel), padding='SAME')
  params = jax.jit(reference.init)(jax.random.key(5), images)['params']
  expected = jax.jit(reference.apply)({'params': params}, images)   # (op by op: a compilation per operation)
  for impl in ('xla', 'patches', 'kernel_rows', 'fourier'):
    ours = Conv(6, kernel, padding='SAME', formulation=Formulation(conv_impl=impl))
    np.testing.assert_allclose(jax.jit(ours.apply)({'params': params}, images), expected, rtol=1e-5, atol=1e-5)
  assert expected.shape == (2, 11, 11, 6)


@pytest.mark.parametrize('side,stride,kernel', [(5, 2, 3), (4, 2, 3), (3, 3, 4)])
def test_transposed_conv_equals_flax_conv_transpose_in_value_and_gradient(side, stride, kernel):
  # The deconv decoder's layer: the same parameters as flax's ConvTranspose (checkpoints
  # load either way), the same values and gradients in every formulation.
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from capsjax.layers import Formulation, TransposedConv  # pylint: disable=g-import-not-at-top
  images = jax.random.normal(jax.random.key(6), (2, side, side + 1, 3))
  reference = nn.ConvTranspose(4, (kernel, kernel), strides=(stride, stride), padding='SAME')
  params = jax.jit(reference.init)(jax.random.key(7), images)['params']
  loss = lambda module: lambda p, x: jnp.sum(jnp.sin(module.apply({'params': p}, x)))
  expected = jax.jit(reference.apply)({'params': params}, images)   # (op by op: a compilation per operation)
  expected_grads = jax.jit(jax.grad(loss(reference), argnums=(0, 1)))(params, images)
  assert expected.shape == (2, side * stride, (side + 1) * stride, 4)
  for impl in ('xla', 'patches'):
    ours = TransposedConv(4, kernel, stride, formulation=Formulation(conv_impl=impl))
    assert jax.tree.map(jnp.shape, jax.eval_shape(ours.init, jax.random.key(7), images)['params']) == jax.tree.map(
        jnp.shape, params)
    np.testing.assert_allclose(jax.jit(ours.apply)({'params': params}, images), expected, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(params, images)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_auto_never_resolves_to_a_choice_measured_slow_and_explicit_ones_say_so():
  from capsjax import formulations  # pylint: disable=g-import-not-at-top
  for option, value, backend in formulations.SLOW_CHOICES:
    if option in ('conv_impl', 'patches_inference', 'routing_loop'):
      assert value not in formulations.choices(option, backend), (option, backend)
  paper = formulations.for_platform({'conv_impl': 'auto', 'dtype': 'auto'}, 'cpu')   # as a run builds it
  assert formulations.slow_choices(paper, 'cpu') == []
  lines = formulations.slow_choices(Formulation(conv_impl='xla', dtype='bfloat16'), 'cpu')
  assert len(lines) == 2 and all(line.startswith('note: model.formulation.') and '\n' not in line for line in lines)
  assert "conv_impl='xla'" in lines[0] and 'conv_inputs' in lines[1]   # the faster way is named
  assert formulations.slow_choices(Formulation(conv_impl='xla'), 'gpu') == []   # slow on CPUs only


def _dot_instructions(compiled_text: str) -> list:
  """(result shape, dimension numbers) of every dot in a compiled module (fused or not)."""
  import re  # pylint: disable=g-import-not-at-top
  return re.findall(r'= (\w+\[[\d,]*\])\{[\d,]*\} dot\([^)]*\), (lhs_batch_dims=\{[\d,]*\}, )?', compiled_text)


@pytest.mark.parametrize('impl', ['fourier', 'patches'])
def test_vmapped_members_reach_the_convolution_as_one_matmul_each(impl):
  # An ensemble's members (steps.make_train_step(ensemble=True) vmaps the whole step) must
  # not become one small matmul per member: the compiled CPU program of 3 members'
  # forward and backward has as many dots as one member's, each carrying the member axis
  # (a batch dimension of size 3, or 3× the rows/columns of the member's own).
  members, batch = 3, 8
  images = jax.random.normal(jax.random.key(0), (members, batch, 12, 12, 16))
  kernels = jax.random.normal(jax.random.key(1), (members, 5, 5, 16, 24))
  loss = lambda x, w: jnp.sum(jnp.sin(ops.conv2d(x, w, 2, impl)))
  one = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(images[0], kernels[0]).compile().as_text()
  vmapped = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)))).lower(images, kernels).compile().as_text()
  single_dots, member_dots = _dot_instructions(one), _dot_instructions(vmapped)
  assert single_dots and len(member_dots) == len(single_dots), (single_dots, member_dots)
  sizes = lambda shape: [int(d) for d in shape[shape.index('[') + 1:-1].split(',') if d]
  for (single_shape, _), (member_shape, _) in zip(sorted(single_dots, key=lambda d: np.prod(sizes(d[0]))),
                                                  sorted(member_dots, key=lambda d: np.prod(sizes(d[0])))):
    assert np.prod(sizes(member_shape)) == members * np.prod(sizes(single_shape)), (single_shape, member_shape)


def test_per_member_convs_give_each_member_a_dense_convolution_and_the_same_values():
  # vmap's own rule turns a vmapped ensemble's XLA convolution into one grouped convolution
  # (feature_group_count = members), forward and backward; 'per_member' runs one dense
  # convolution per member instead (ops.member_conv): the same values and gradients, no
  # grouped convolution left, also where the kernel is shared (the members' images merged
  # into one batch) and under a second vmap (views of each member's images). The GPU's
  # strided form (space_to_depth) calls XLA's, so both are covered.
  members, batch = 3, 4
  images = jax.random.normal(jax.random.key(0), (members, batch, 11, 11, 6))
  kernels = jax.random.normal(jax.random.key(1), (members, 3, 3, 6, 5))

  def step(how, in_axes, views=False):
    loss = lambda x, w: jnp.sum(jnp.sin(ops.conv2d(x, w, 2, 'space_to_depth', member_convs=how)))
    if views:   # [views, batch, ...] per member, the kernel shared by the views
      loss = (lambda inner: lambda x, w: jnp.sum(jax.vmap(inner, in_axes=(0, None))(jnp.stack([x, -x]), w)))(loss)
    return jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=in_axes))

  for in_axes, views in (((0, 0), False), ((0, None), False), ((0, 0), True)):
    arguments = (images, kernels if in_axes[1] == 0 else kernels[0])
    grouped, per_member = step('grouped', in_axes, views), step('per_member', in_axes, views)
    for ours, theirs in zip(jax.tree.leaves(per_member(*arguments)), jax.tree.leaves(grouped(*arguments))):
      np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-4, err_msg=str((in_axes, views)))
    assert 'feature_group_count' not in per_member.lower(*arguments).compile().as_text(), (in_axes, views)
    if in_axes[1] == 0:   # what the default rule makes of it, which 'per_member' replaces
      assert 'feature_group_count' in grouped.lower(*arguments).compile().as_text(), (in_axes, views)
