"""The `make demo` walk-through: spawn a mesh, call endpoints, move a tensor rank to rank,
survive a rank's crash."""

import os
import time

from monarch_kernel import Actor, ActorError, ProcessDied, RDMABuffer, current_rank, endpoint, this_host
from monarch_kernel.data import transports


class Trainer(Actor):
    def __init__(self, lr: float):
        self.lr = lr
        self.steps = 0

    @endpoint
    def step(self, batch: int) -> float:
        self.steps += 1
        loss = 1.0 / (self.steps * batch) + 0.01 * current_rank().rank
        print(f"step {self.steps}: loss {loss:.3f}")
        return loss

    @endpoint
    async def params(self) -> dict:
        return {"lr": self.lr, "steps": self.steps, "pid": os.getpid()}

    @endpoint
    def share_weights(self) -> RDMABuffer:
        import torch

        self.weights = torch.full((16 << 20,), float(current_rank().rank))  # 64 MiB
        return RDMABuffer(self.weights, name=f"weights of rank {current_rank().rank}")

    @endpoint
    async def pull(self, buf: RDMABuffer) -> str:
        import torch

        dst = torch.empty(buf.size // 4)
        took = []
        for _ in range(2):  # the first read also maps the segment and faults in dst's pages
            t0 = time.perf_counter()
            await buf.read_into(dst)
            took.append((time.perf_counter() - t0) * 1e3)
        return (f"read {buf.size >> 20} MiB over {buf.transport()}: first {took[0]:.1f} ms, "
                f"then {took[1]:.1f} ms ({buf.size / took[1] / 1e3:,.0f} MB/s); mean {dst.mean():.1f}")

    @endpoint
    def crash(self) -> None:
        os._exit(3)

    @endpoint
    def divide(self, x: int) -> float:
        return 1 / x


def main() -> None:
    t0 = time.perf_counter()
    with this_host().spawn_procs(per_host={"gpus": 4}) as procs:
        trainers = procs.spawn("trainers", Trainer, lr=0.1)
        print(f"spawned {procs} with {trainers} in {time.perf_counter() - t0:.2f} s")

        losses = trainers.step.call(8).get()
        print("losses per rank:", losses)
        print("rank 2's params:", trainers.slice(gpus=2).params.call_one().get())

        print("transports here:", ", ".join(f"{t['name']} ({'yes' if t['available'] else 'no'})" for t in transports()))
        buf = trainers.slice(gpus=0).share_weights.call_one().get()
        print(buf, "->", trainers.slice(gpus=2).pull.call_one(buf).get())

        try:
            trainers.slice(gpus=1).divide.call_one(0).get()
        except ActorError as e:
            print(f"rank 1 raised, and we caught it as {type(e.__cause__).__name__}: {e.__cause__}")

        try:
            trainers.slice(gpus=3).crash.call_one().get()
        except ProcessDied as e:
            print(f"rank 3 died ({e.death.how()}); the controller lives on")

        alive = trainers.slice(gpus=slice(0, 3))
        print("ranks 0-2 still answer:", list(alive.step.call(8).get().values()))
    print("mesh stopped; every rank has exited")


if __name__ == "__main__":
    main()
