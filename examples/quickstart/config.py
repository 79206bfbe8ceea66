"""The quickstart job in the platform's SDK format (``truss train push config.py``)."""

from truss_train import definitions

training_job = definitions.TrainingJob(
    image=definitions.Image(base_image="python:3.11-slim"),
    compute=definitions.Compute(cpu_count=1, memory="1Gi"),
    runtime=definitions.Runtime(
        start_commands=["python train.py"],
        environment_variables={"STEPS": "20", "SAVE_EVERY": "10"},
        checkpointing_config=definitions.CheckpointingConfig(enabled=True),
    ),
    name="quickstart",
)

training_project = definitions.TrainingProject(name="quickstart", job=training_job)
