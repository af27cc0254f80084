"""Test what you build on the library the way the library tests itself.

Hypothesis strategies (time grids, transition batches with masks and deterministic
intervals, reward groups with ties and constant groups, advantages of both shapes, and any
objective's training batches from its own rollout), jitted evaluations of an objective, and
its invariants as assertion functions. They take any `AbstractRLObjective`: the invariants of
every objective (loss and gradient finite, advantages normalised within groups, an update
moves the policy's trainable part alone) are stated on the abstract interface, and those of
an objective that rescores recorded transitions (ratio 1 on-policy, clip fractions 0,
kept-count denominator, masked entries inert) on `AbstractTransitionObjective`.
`check_objective_invariants` runs every one that applies and names those that do not. For
example:

```python
from hypothesis import given
import flowgrpo_eqx.testing as fgt

objective = ...  # any AbstractRLObjective over your model
variables = objective.init(jax.random.key(0))
rollout = FlowRollout(objective, reward, groups=4, steps=4)

@fgt.property_settings(5)
@given(sample=fgt.training_batches(objective, variables, rollout, rows))
def test_invariants(sample):
    fgt.check_objective_invariants(objective, variables, sample)
```

This subpackage needs Hypothesis (`pip install -e '.[testing]'`); `import
flowgrpo_eqx` never imports it.
"""

from ._helpers import (
    TRANSITION_FIELDS as TRANSITION_FIELDS,
    all_finite as all_finite,
    assert_trees_close as assert_trees_close,
    assert_trees_equal as assert_trees_equal,
    gradient_leaves as gradient_leaves,
    log_probs as log_probs,
    loss_only as loss_only,
    loss_value_and_grad as loss_value_and_grad,
    map_rows as map_rows,
    replace_fields as replace_fields,
)
from ._invariants import (
    assert_advantages_group_normalised as assert_advantages_group_normalised,
    assert_denominator_is_kept_count as assert_denominator_is_kept_count,
    assert_duplication_doubles_total as assert_duplication_doubles_total,
    assert_grid_endpoints as assert_grid_endpoints,
    assert_group_advantages_invariants as assert_group_advantages_invariants,
    assert_loss_finite as assert_loss_finite,
    assert_masked_entries_inert as assert_masked_entries_inert,
    assert_row_permutation_invariant as assert_row_permutation_invariant,
    assert_sde_invariants as assert_sde_invariants,
    assert_transition_chunk_agrees as assert_transition_chunk_agrees,
    assert_unchanged_policy_ratio_one as assert_unchanged_policy_ratio_one,
    assert_update_leaves_frozen as assert_update_leaves_frozen,
    assert_zero_advantages_zero_gradient as assert_zero_advantages_zero_gradient,
    aux_means as aux_means,
    recorded_transitions as recorded_transitions,
    with_transitions as with_transitions,
)
from ._strategies import (
    MASK_PROBABILITIES as MASK_PROBABILITIES,
    SHAPES as SHAPES,
    CollectedBatch as CollectedBatch,
    advantages as advantages,
    collected_batch as collected_batch,
    default_rows as default_rows,
    property_settings as property_settings,
    reward_groups as reward_groups,
    rollout_like_transitions as rollout_like_transitions,
    seeds as seeds,
    time_grids as time_grids,
    training_batches as training_batches,
    transition_masks as transition_masks,
    transitions as transitions,
)
from ._suite import (
    EVERY_OBJECTIVE as EVERY_OBJECTIVE,
    TRANSITION_OBJECTIVE as TRANSITION_OBJECTIVE,
    InvariantReport as InvariantReport,
    check_objective_invariants as check_objective_invariants,
)
