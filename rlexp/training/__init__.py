"""Training components: batching, the policy update, the shared step loop, checkpoints, lr schedules."""
