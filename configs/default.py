"""The default experiment: a character-level transformer LM on Python's own source, mixed_bf16.

    mpjax train                                  # this config
    mpjax train --config.steps=100               # any value overridden
    mpjax train --config.mesh.fsdp=8             # FSDP over 8 devices (the batch over all)
    mpjax compare default --policies fp32,mixed_bf16,mixed_fp16

The other configs import this one and override only what differs.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.policy = "mixed_bf16"  # precision policy (mpjax.get_policy); MPJAX_POLICY overrides it
  config.loss_scale = "default"  # "default" (dynamic for fp16, none otherwise), "dynamic", "none"
  config.seed = 0  # seed of initialisation and of every batch (a batch is a function of step)
  config.steps = 600  # training steps
  config.batch_size = 32  # examples per step, split over the devices
  config.learning_rate = 3e-3  # peak AdamW learning rate
  config.warmup_steps = 50  # linear warm-up steps, then cosine decay to 0 at config.steps
  config.weight_decay = 0.0  # AdamW weight decay
  config.max_grad_norm = 1.0  # clip gradients to this global norm; 0 turns clipping off
  config.log_every = 20  # steps between metric lines (metrics.jsonl and the progress bar)
  config.eval_every = 200  # steps between test-set evaluations; 0 means only at the end
  config.checkpoint_every = 200  # steps between checkpoints; 0 means only at the end
  config.num_devices = 0  # devices the mesh spans; 0 means all (of every process)
  config.mesh = ml_collections.ConfigDict()  # mesh axis sizes; their product is the devices
  config.mesh.data = 0  # data-parallel axis; 0 means the devices the other axes leave
  config.mesh.fsdp = 1  # params and optimizer state sharded over this many devices (FSDP)
  config.run_dir = ""  # checkpoints and metrics; "" means runs/<config name>
  config.autocast_rules = "{}"  # autocast rules as a dict literal, e.g. "{'*attn*': 'fp32'}"
  config.autoprecision = False  # before training, pick autocast_rules with mpjax.suggest_rules
  config.health_every = 0  # steps between gradient-health records (mpjax.grad_health); 0: never
  config.stop_after_skips = 100  # stop a run that skipped this many steps in a row; 0: never
  config.stop_at_min_scale = 1000  # stop when the dynamic loss scale sat at its minimum this long
  config.data = ml_collections.ConfigDict()
  config.data.name = "char_corpus"  # mpjax.data.load_dataset name
  config.data.seq_len = 64  # characters per training window
  config.data.max_chars = 2_000_000  # characters of the standard library's source to use
  config.model = ml_collections.ConfigDict()
  config.model.name = "transformer_lm"  # "mlp", "cnn" or "transformer_lm"
  config.model.d_model = 128  # width of the residual stream (a multiple of 8)
  config.model.n_heads = 4  # attention heads (d_model / n_heads a multiple of 8)
  config.model.n_layers = 2  # transformer blocks
  config.model.d_ff = 512  # width of the GELU MLP (a multiple of 8)
  return config
