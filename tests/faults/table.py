"""Planted faults: small semantic changes to the numerical core and the data path, each with
the tests that must catch it (`python tests/faults/run_faults.py` plants them one at a time
in a copy of the repository). `old` must occur exactly once in `file`, so a change to the
source that moves a snippet shows up here instead of silently planting nothing.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


O = 'tests/objectives/simcse_objective_test.py'
STEP = 'tests/train/step_test.py'
AFFINE = 'tests/calibrate/calibrate_affine_test.py'
LAYERS = 'tests/flows/flow_layers_test.py'
METRICS = 'tests/eval/metrics_test.py'
TRANSFER = 'tests/eval/transfer_test.py'
PARITY = 'tests/models/bert_parity_test.py::test_tiny_random_parity'
NATIVE = 'tests/native/blas_gemm_test.py'

FAULTS = (
    # ---- objectives
    Fault('temperature ignored', 'jaxsim/objectives/simcse.py',
          'return _cross_entropy_diag(cosine_matrix(z1, z2) / temp)',
          'return _cross_entropy_diag(cosine_matrix(z1, z2))',
          (f'{O}::test_unsup_matches_numpy',)),
    Fault('hard-negative weight off', 'jaxsim/objectives/simcse.py',
          'neg = cosine_matrix(z1, z3) / temp + hard_negative_weight * jnp.eye(n',
          'neg = cosine_matrix(z1, z3) / temp + 0.0 * jnp.eye(n',
          (f'{O}::test_sup_matches_numpy',)),
    Fault('hard negatives left out of the softmax', 'jaxsim/objectives/simcse.py',
          'return _cross_entropy_diag(jnp.concatenate([pos, neg], axis=1))',
          'return _cross_entropy_diag(pos)',
          (f'{O}::test_sup_matches_reference_torch_formulation',)),
    Fault('positive is not the diagonal', 'jaxsim/objectives/simcse.py',
          'return -jnp.mean(logp[jnp.arange(n), jnp.arange(n)])',
          'return -jnp.mean(logp[jnp.arange(n), (jnp.arange(n) + 1) % n])',
          (f'{O}::test_replica_mean_gradient_equals_the_references_data_parallel_gradient',)),
    Fault('vectors not normalized in the cosine', 'jaxsim/objectives/simcse.py',
          'return x / jnp.maximum(norm, _EPS)',
          'return x',
          (f'{O}::test_unsup_matches_numpy',)),
    Fault('uniformity temperature ignored', 'jaxsim/objectives/simcse.py',
          'logits = jnp.where(upper, -t * sq, -jnp.inf)',
          'logits = jnp.where(upper, -sq, -jnp.inf)',
          (f'{O}::test_alignment_uniformity_match_numpy',)),
    # ---- train step
    Fault('no dropout in training', 'jaxsim/train/step.py',
          'z = encoder.apply({\'params\': params}, ids, mask, types, train=True,',
          'z = encoder.apply({\'params\': params}, ids, mask, types, train=False,',
          (f'{STEP}::test_one_sentence_gives_two_dropout_views_and_the_head_in_training',)),
    Fault('gradient divisor not applied', 'jaxsim/train/step.py',
          'grads = jax.tree.map(lambda g: g / grad_divisor, grads)',
          'grads = jax.tree.map(lambda g: g / 1.0, grads)',
          (f'{STEP}::test_replica_mean_divides_the_gradient_before_the_update',)),
    Fault('replica_mean divisor of the paper config ignored', 'jaxsim/train/loop.py',
          'return float(cfg.grad_replicas or sharding_lib.batch_shards(mesh))',
          'return 1.0',
          ('tests/train/simcse_reference_test.py::test_sup_steps_match_reference',)),
    Fault('accumulated loss not averaged', 'jaxsim/train/step.py',
          'value = value / accum',
          'value = value / 1',
          (f'{STEP}::test_grad_accumulation_averages_any_aux_the_objective_returns',)),
    Fault('non-finite step applied', 'jaxsim/train/step.py',
          'ok = jnp.isfinite(value) & jnp.isfinite(grad_norm)',
          'ok = jnp.isfinite(value) | True',
          (f'{STEP}::test_non_finite_loss_leaves_the_state_unchanged',)),
    # ---- poolers and weights
    Fault('avg_first_last takes the embedding layer', 'jaxsim/models/poolers.py',
          '"avg_first_last": (1, -1)',
          '"avg_first_last": (0, -1)',
          (PARITY,)),
    Fault('padding counted in the mean pooler', 'jaxsim/models/poolers.py',
          'return total / jnp.maximum(jnp.sum(mask, axis=1), 1.0)',
          'return total / hidden.shape[1]',
          (PARITY,)),
    Fault('cls pooler without tanh', 'jaxsim/models/poolers.py',
          'pooled = jnp.tanh(dense(cls))',
          'pooled = dense(cls)',
          (PARITY,)),
    Fault('export Dense weight not transposed', 'jaxsim/models/poolers.py',
          '{"linear.weight": kernel.T,',
          '{"linear.weight": kernel,',
          ('tests/io/export_test.py::test_every_pooler_sentence_transformers_parity',)),
    Fault('query kernel loaded untransposed', 'jaxsim/io/hf.py',
          'return value.T if path[-1] == "kernel" else value',
          'return value.T if path[-1] == "kernel" and "query" not in path else value',
          ('tests/io/pretrained_test.py::test_pytorch_bin_checkpoint', PARITY)),
    # ---- affine calibrations
    Fault('whitening eigenvectors unsorted', 'jaxsim/calibrate/affine.py',
          'return np.maximum(s[::-1], 0.0), u[:, ::-1]',
          'return np.maximum(s[::-1], 0.0), u',
          (AFFINE,)),
    Fault('whitening scales by 1/s instead of 1/sqrt(s)', 'jaxsim/calibrate/affine.py',
          'w = u[:, :k] / np.sqrt(s[:k] + eps)',
          'w = u[:, :k] / (s[:k] + eps)',
          (AFFINE,)),
    Fault('whitening covariance with ddof=0', 'jaxsim/calibrate/affine.py',
          'cov = np.cov(x, rowvar=False)',
          'cov = np.cov(x, rowvar=False, ddof=0)',
          (AFFINE,)),
    Fault('sn divides by the sample std', 'jaxsim/calibrate/affine.py',
          '        std = x.std(axis=0)\n        if eps > 0:',
          '        std = x.std(axis=0, ddof=1)\n        if eps > 0:',
          (f'{AFFINE}::test_affine_matches_the_definition_and_apply',)),
    Fault('natsv nulls the wrong directions', 'jaxsim/calibrate/affine.py',
          'vk = v[:, : int(arg)]',
          'vk = v[:, 1: int(arg) + 1]',
          (f'{AFFINE}::test_affine_matches_the_definition_and_apply',)),
    Fault('calibration fitted but not applied in the STS evaluation', 'jaxsim/eval/runner.py',
          'own = own.replace(cal.apply(own.matrix))',
          'own = own.replace(own.matrix)',
          ('tests/calibrate/calibrate_eval_test.py',)),
    # ---- flows
    Fault('flow logdet sign', 'jaxsim/flows/prior.py',
          'return -(standard_normal_logprob(z) + logdet)',
          'return -(standard_normal_logprob(z) - logdet)',
          ('tests/calibrate/calibrate_flow_test.py::test_nll_is_the_change_of_variables_density',)),
    Fault('bits/dim in nats', 'jaxsim/flows/prior.py',
          'return nll / (dim * math.log(2.0))',
          'return nll / dim',
          (f'{LAYERS}::test_prior_and_nll_units',)),
    Fault('actnorm scale factor dropped', 'jaxsim/flows/layers.py',
          '        s = self.logscale_factor * logs\n',
          '        s = logs\n',
          (f'{LAYERS}::test_layer_inverse_and_logdet',)),
    Fault('reverse layer is the identity', 'jaxsim/flows/layers.py',
          'return FlowOutput(x[:, ::-1], constant_logdet(x, 0.0))',
          'return FlowOutput(x, constant_logdet(x, 0.0))',
          (f'{LAYERS}::test_reverse_is_the_anti_identity_without_params',)),
    Fault('1x1 linear logdet sign', 'jaxsim/flows/layers.py',
          'return FlowOutput(x @ self.kernel, constant_logdet(x, logabsdet))',
          'return FlowOutput(x @ self.kernel, constant_logdet(x, -logabsdet))',
          (f'{LAYERS}::test_layer_inverse_and_logdet',)),
    # ---- STS metrics and protocol
    Fault('Spearman replaced by Pearson', 'jaxsim/eval/metrics.py',
          'return float(scipy.stats.spearmanr(scores, gold).statistic * 100.0)',
          'return float(scipy.stats.pearsonr(scores, gold).statistic * 100.0)',
          (METRICS,)),
    Fault("STS 'all' aggregation is the subset mean", 'jaxsim/eval/metrics.py',
          'all=spearman_of_scores_x100(sims, golds),',
          'all=float(sps.mean()),',
          (METRICS,)),
    Fault('wmean unweighted', 'jaxsim/eval/metrics.py',
          'wmean=float((sps * sizes).sum() / sizes.sum()),',
          'wmean=float(sps.mean()),',
          (METRICS,)),
    Fault('cosine divides by the first norm twice', 'jaxsim/eval/metrics.py',
          "return np.einsum('nd,nd->n', a, b) / (na * nb)",
          "return np.einsum('nd,nd->n', a, b) / (na * na)",
          (METRICS,)),
    Fault("flow's paper fit set not repeated", 'jaxsim/eval/protocol.py',
          "repeats = 3 if family == 'flow' else 1",
          'repeats = 1',
          ('tests/eval/runner_test.py::test_paper_fit_set_for_flows_repeats_sts12_and_finds_'
           'sick_test_in_another_root',)),
    # ---- transfer tasks
    Fault('transfer folds not shuffled per class', 'jaxsim/eval/transfer.py',
          '        rng.shuffle(folds)\n',
          '        pass\n',
          (f'{TRANSFER}::test_stratified_kfold_matches_sklearn',)),
    Fault('transfer samples not in SentEval order', 'jaxsim/eval/transfer.py',
          'return np.asarray(sorted(range(len(keys)), key=keys.__getitem__), np.int64)',
          'return np.arange(len(keys), dtype=np.int64)',
          (f'{TRANSFER}::test_f1_and_order',)),
    Fault('MRPC features without abs', 'jaxsim/eval/transfer.py',
          'return np.concatenate([np.abs(u - v), u * v], axis=1)',
          'return np.concatenate([u - v, u * v], axis=1)',
          (f'{TRANSFER}::test_evaluate_transfer_on_real_subset',)),
    # ---- data path
    Fault('sentence lines not stripped', 'jaxsim/data/readers.py',
          "sentences = [s for s in (line.strip() for line in text.split('\\n')) if s]",
          "sentences = [s for s in (line for line in text.split('\\n')) if s.strip()]",
          ('tests/data/readers_fuzz_test.py::test_fuzz_sentence_file',)),
    Fault('STS evaluation data in the training corpus', 'jaxsim/data/readers.py',
          "'MPQA/mpqa.pos', 'MPQA/mpqa.neg')",
          "'MPQA/mpqa.pos', 'MPQA/mpqa.neg', 'SICK/SICK_train.txt')",
          ('tests/data/readers_test.py::test_corpus_from_senteval_excludes_sts_and_dedups',)),
    # ---- search
    Fault('approximate search ignores its recall target', 'jaxsim/search/topk.py',
          'top, pos = jax.lax.approx_max_k(scores, block_k, recall_target=recall_target)',
          'top, pos = jax.lax.top_k(scores, block_k)',
          ('tests/search/search_test.py::test_approximate_search_selects_with_the_recall_target',)),
    # ---- the bf16 BLAS kernel (C++ handler and its use in the encoder's products)
    Fault('row blocks of a transposed first operand all read its first columns',
          'jaxsim/native/bf16_gemm.cc',
          'a_i += transpose_a ? start : start * lda;',
          'a_i += transpose_a ? 0 : start * lda;',
          (f'{NATIVE}::test_product_equals_float64_product_of_the_same_operands',)),
    Fault('column blocks of a transposed second operand start at the wrong row',
          'jaxsim/native/bf16_gemm.cc',
          'b_i += transpose_b ? start * ldb : start;',
          'b_i += start;',
          (f'{NATIVE}::test_product_equals_float64_product_of_the_same_operands',)),
    Fault('input gradient through the untransposed weight', 'jaxsim/models/ops.py',
          'dx = blas_gemm.bf16_gemm(g_rows, w, transpose_b=True).reshape(x.shape)',
          'dx = blas_gemm.bf16_gemm(g_rows, w, transpose_b=False).reshape(x.shape)',
          (f'{NATIVE}::test_encoder_matmul_through_the_blas_equals_xla_values_and_gradients',)),
    # ---- the MLM term
    Fault('MLM term does not reach the encoder', 'jaxsim/objectives/mlm.py',
          'logits = mlm_logits(encoder, params, masked,',
          "logits = mlm_logits(encoder, {**params, 'bert': jax.lax.stop_gradient(params['bert'])},"
          ' masked,',
          ('tests/train/mlm_term_test.py::test_total_is_contrastive_plus_weighted_mlm',)),
)
