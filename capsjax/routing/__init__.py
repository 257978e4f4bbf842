"""Routing between capsule layers as pure functions of arrays: the shared machinery in
`core` (squash, couplings, the iteration loop, shared-transform votes) and `base` (the
registry, `route`, the options), and one file per algorithm, each registering itself.

Add a routing: a new file here with one `@register_routing` function, imported below.
"""
from capsjax.routing.core import (MAX_ROUTING_ITERATIONS, UNROLLED_INFERENCE, Array, coordinate_offsets, coupling_coefficients,
                                  iterate, loop_length, pooled_votes, shared_votes, squash, vector_norm, vote_dots)
from capsjax.routing.base import (LAYER_INPUTS, ROUTINGS, RoutingResult, as_result, call, configurable_routing_options,
                                  own_section_problems, own_routing_options, register_routing, route, routing_option_defaults,
                                  routing_option_keys, shared_form)
# Registration order is ROUTINGS.names()'s order.
from capsjax.routing.dynamic import (coupling_changes, dynamic, dynamic_routing, per_capsule_dynamic_routing, routing_logit_changes,
                                     shared_dynamic_routing)
from capsjax.routing.em import em
from capsjax.routing.self_attention import efficient_squash, self_attention
from capsjax.routing.inverted_dot_product import inverted_dot_product, layer_norm
from capsjax.routing.self_routing import self_routing
from capsjax.routing.uniform import uniform
from capsjax.routing.max_pooling import max_routing
from capsjax.routing.variational_bayes import variational_bayes

__all__ = [
    'MAX_ROUTING_ITERATIONS', 'UNROLLED_INFERENCE', 'Array', 'coordinate_offsets', 'coupling_coefficients', 'iterate', 'loop_length', 'pooled_votes',
    'shared_votes', 'squash', 'vector_norm', 'vote_dots',
    'LAYER_INPUTS', 'ROUTINGS', 'RoutingResult', 'as_result', 'call', 'configurable_routing_options', 'own_section_problems', 'own_routing_options', 'register_routing', 'route',
    'routing_option_defaults', 'routing_option_keys', 'shared_form',
    'coupling_changes', 'dynamic', 'dynamic_routing', 'per_capsule_dynamic_routing', 'routing_logit_changes', 'shared_dynamic_routing',
    'em', 'efficient_squash', 'self_attention', 'inverted_dot_product', 'layer_norm', 'self_routing',
    'uniform', 'max_routing', 'variational_bayes',
]
