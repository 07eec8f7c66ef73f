"""A Monarch program of the shape of its reinforcement-learning examples, written against
``monarch.actor`` and run as a script with only the import changed: generators whose
``start`` endpoint returns at once and leaves a rollout task running that sends into a
trainer's ``Port``; the trainer takes batches and sends its new weights back to one
generator with ``send(..., selection="choose")``; stopping the generators cancels their
tasks and runs ``__cleanup__``.  Written here in our own words."""

from __future__ import annotations

import pytest
from support.scripts import run_script, write_script

RL_LOOP = '''
    import asyncio

    from monarch_kernel import Actor, Channel, Port, current_rank, endpoint, send, this_host


    class Generator(Actor):
        def __init__(self, weights: int):
            self.weights = weights
            self.rank = current_rank().rank
            self.rollouts = None

        @endpoint
        async def start(self, results: Port) -> None:
            # Returns at once, so that the other endpoints always make progress.
            self.rollouts = asyncio.create_task(self._rollouts(results))

        async def _rollouts(self, results: Port) -> None:
            sample = 0
            while True:
                await asyncio.sleep(0.005)  # a rollout takes a while
                results.send({"generator": self.rank, "weights": self.weights, "sample": sample})
                sample += 1

        @endpoint
        async def update_weights(self, weights: int) -> None:
            self.weights = weights

        @endpoint
        async def rollouts_running(self) -> bool:
            return self.rollouts is not None and not self.rollouts.done()

        async def __cleanup__(self, exc) -> None:
            print(f"generator {self.rank} cleaned up, rollouts cancelled: {self.rollouts.cancelled()}",
                  flush=True)


    class Trainer(Actor):
        def __init__(self):
            self.weights = 0

        @endpoint
        async def train(self, generators: Generator, steps: int, batch_size: int) -> list:
            results, samples = Channel.open()
            await generators.start.call(results)
            history = []
            for _step in range(steps):
                batch = [await samples.recv() for _ in range(batch_size)]
                self.weights += 1
                send(generators.update_weights, (self.weights,), {}, selection="choose")
                history.append(max(s["weights"] for s in batch))
            return history


    def main() -> None:
        generator_procs = this_host().spawn_procs(per_host={"gpus": 2})
        trainer_procs = this_host().spawn_procs(per_host={"gpus": 1})
        generators = generator_procs.spawn("generators", Generator, 0)
        trainer = trainer_procs.spawn("trainer", Trainer)
        history = trainer.train.call_one(generators, 20, 4).get()
        print(f"steps trained: {len(history)}", flush=True)
        print(f"newer weights reached the generators: {history[-1] > history[0]}", flush=True)
        print(f"rollouts still running: {list(generators.rollouts_running.call().get().values())}", flush=True)
        generators.stop().get()
        generator_procs.stop().get()
        trainer_procs.stop().get()
        print("rl loop done", flush=True)


    if __name__ == "__main__":
        main()
'''


@pytest.mark.timeout(180)
def test_an_rl_loop_with_background_rollouts_runs_with_the_import_changed(tmp_path):
    out = run_script(write_script(tmp_path, "rl_loop.py", RL_LOOP), timeout=150)
    assert out.returncode == 0, f"rl_loop exited {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "steps trained: 20" in out.stdout
    assert "newer weights reached the generators: True" in out.stdout
    assert "rollouts still running: [True, True]" in out.stdout
    for rank in range(2):
        assert f"generator {rank} cleaned up, rollouts cancelled: True" in out.stdout, out.stdout
    assert "Task was destroyed but it is pending" not in out.stdout + out.stderr
    assert "rl loop done" in out.stdout, out.stdout
