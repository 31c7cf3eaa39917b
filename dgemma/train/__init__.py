"""Training: the recipe and its loop, the diffusion losses and the NELBO, run directories, torchrun, the
memory pre-flight of a step."""
