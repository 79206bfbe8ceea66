"""The hf-trainer example in the platform's SDK format (``truss train push config.py``): the
base model is staged from the Hub through BDN `weights` before the Trainer starts."""

from truss.base.truss_config import WeightsSource
from truss_train import definitions

training_job = definitions.TrainingJob(
    image=definitions.Image(base_image="pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime"),
    compute=definitions.Compute(cpu_count=4, memory="8Gi"),
    weights=[
        WeightsSource(
            source="hf://hf-internal-testing/tiny-random-LlamaForCausalLM@main",
            mount_location="/app/base",
            allow_patterns=["*.json", "*.safetensors"],
        )
    ],
    runtime=definitions.Runtime(
        start_commands=["python train.py"],
        environment_variables={"STEPS": "20", "SAVE_STEPS": "10"},
        checkpointing_config=definitions.CheckpointingConfig(enabled=True),
    ),
    name="hf-trainer",
)

training_project = definitions.TrainingProject(name="hf-trainer", job=training_job)
