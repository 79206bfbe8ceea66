"""The torch-ddp example in the platform's SDK format (``truss train push config.py``).

Resume from the project's latest checkpoint by adding to the Runtime::

    load_checkpoint_config=definitions.LoadCheckpointConfig(
        enabled=True,
        checkpoints=[definitions.BasetenLatestCheckpoint(project_name="torch-ddp")],
    )
"""

from truss_train import definitions

training_job = definitions.TrainingJob(
    image=definitions.Image(base_image="pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime"),
    compute=definitions.Compute(node_count=1, cpu_count=4, memory="8Gi"),
    runtime=definitions.Runtime(
        start_commands=["torchrun train.py"],
        environment_variables={"STEPS": "20", "SAVE_EVERY": "10"},
        checkpointing_config=definitions.CheckpointingConfig(enabled=True),
    ),
    name="torch-ddp",
)

training_project = definitions.TrainingProject(name="torch-ddp", job=training_job)
