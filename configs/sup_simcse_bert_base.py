"""Supervised SimCSE, BERT-base, as the reference trains it (Gao et al. 2021, Table D.1;
princeton-nlp/SimCSE run_sup_example.sh: 4 GPUs x 128 with DDP and the HF Trainer).

NLI triplets (sent0, sent1, hard_neg CSV), global batch 512, lr 5e-5, max_len 32, 3 epochs,
temp 0.05, 'cls' pooler with the MLP head kept at evaluation. Like the reference:
  - the last partial batch of each epoch is kept (last_batch='keep'; 539 steps an epoch on
    the 275,601 triplets of nli_for_simcse.csv);
  - STS-B dev only at multiples of 125 steps (no step-0, no final-step evaluation/selection);
  - the gradient is grad(global loss) / 4, what its 4 DDP ranks produce (each back-propagates
    through its own rows of the all-gathered batch, DDP averages): grad_reduction=
    'replica_mean' with grad_replicas=4, whatever this mesh is. It matters through the
    clipping at max_grad_norm 1.0.
Needs an accelerator and bert-base-uncased (a local HF folder or hub id).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model='bert-base-uncased',
        dropout=0.1,
        pooler='cls',
        # The reference trains with --fp16 (the HF Trainer's mixed precision); bf16 compute with
        # float32 master weights is its TPU counterpart.
        dtype='bfloat16',
        mlp_only_train=False,
        objective='sup',
        objective_kwargs=dict(temp=0.05, hard_negative_weight=0.0),
        train_file='data/nli_for_simcse.csv',
        data_format='csv',
        max_len=32,
        last_batch='keep',
        batch_size=512,
        num_epochs=3.0,
        learning_rate=5e-5,
        max_grad_norm=1.0,
        grad_reduction='replica_mean',
        grad_replicas=4,
        seed=42,
        eval_every=125,
        eval_at_start=False,
        eval_at_end=False,
        log_every=25,
    ))
