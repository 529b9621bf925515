"""Running the model for one scheduled step: device plan, model runner, sampling, CUDA graphs,
the fused decode step and the second KV tier."""
