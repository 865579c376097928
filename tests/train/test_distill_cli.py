from specdistill.train.distill import main


def test_cpu_launch_with_several_processes_is_refused(monkeypatch, capsys):
    # what `accelerate launch --cpu --num_processes 2` leaves in the environment of its ONE process
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for key in ("WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert main(["train.max_steps=1"]) == 2
    assert "--multi_gpu --num_processes N" in capsys.readouterr().err


def test_recipe_errors_exit_2_with_the_key(capsys):
    assert main(["train.max_stepz=3"]) == 2
    assert "unknown recipe key 'train.max_stepz'" in capsys.readouterr().err
