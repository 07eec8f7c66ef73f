"""A new TCP port that a listen hook cannot have at the far end of its forward (an ssh ``-R``
or a login node's relay to the same port of another host, where another program holds it):
the process listens at another port and every hook hears that one instead, before anyone is
given an address (fresh clone's CI: a relay on the login node found an srun's port there)."""

from __future__ import annotations

import socket

import pytest
from support.actors import wait_for

from monarch_kernel.runtime import PortTaken
from monarch_kernel.runtime.net.network import PORT_TRIES

pytestmark = pytest.mark.timeout(60)


class Far:
    """A listen hook standing for a forward to another host whose programs hold ``taken`` ports."""

    def __init__(self, refuse: int):
        self.refuse = refuse  # how many ports in a row are taken there
        self.heard: list[str] = []

    def __call__(self, address: str) -> None:
        self.heard.append(address)
        if len(self.heard) <= self.refuse:
            raise PortTaken(f"port {address.rsplit(':', 1)[1]} is in use there")


def _listens(address: str) -> bool:
    host, port = address[len("tcp://"):].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


def test_a_thread_inbox_whose_port_is_taken_far_away_listens_at_another(network, tmp_path):
    network.listen("127.0.0.1")
    seen: list[str] = []
    network.add_listen_hook(seen.append)  # a forward that succeeds (another host's tunnel)
    far = Far(refuse=2)
    network.add_listen_hook(far)
    inbox = network.thread_inbox(f"ipc://{tmp_path}/main", 1)
    try:
        assert len(far.heard) == 3 and len(set(far.heard)) == 3, far.heard
        assert seen == far.heard  # every hook heard every port tried, in order
        assert inbox.net_address == far.heard[-1]
        assert network.tcp_addresses()[-1] == inbox.net_address
        assert not set(far.heard[:2]) & set(network.tcp_addresses())  # the taken ones were never handed out
        assert _listens(inbox.net_address)
        assert wait_for(lambda: not any(_listens(a) for a in far.heard[:2]), timeout=30)  # this process let them go
        assert network.answerable(inbox, "tcp://10.0.0.1:1") == inbox.net_address
    finally:
        inbox.close()


def test_the_main_inbox_moves_to_another_port_before_its_address_is_returned(network):
    far = Far(refuse=1)
    network.add_listen_hook(far)
    address = network.listen("127.0.0.1")
    assert address == far.heard[-1] == network.main.net_address != far.heard[0]
    assert network.tcp_addresses() == [address] and network.net_address == address
    assert _listens(address)
    assert wait_for(lambda: not _listens(far.heard[0]), timeout=30)  # ZeroMQ closes an unbound port soon after


def test_no_port_free_far_away_is_an_error_naming_the_port_and_the_tries(network, tmp_path):
    network.listen("127.0.0.1")
    before = network.tcp_addresses()
    far = Far(refuse=10 * PORT_TRIES)
    network.add_listen_hook(far)
    with pytest.raises(PortTaken, match=rf"is in use there \({PORT_TRIES} ports tried\)"):
        network.thread_inbox(f"ipc://{tmp_path}/main", 1)
    assert len(far.heard) == PORT_TRIES
    assert network.tcp_addresses() == before
    assert wait_for(lambda: not any(_listens(a) for a in far.heard), timeout=30)  # the inbox was closed


def test_another_error_of_a_hook_is_not_retried(network, tmp_path):
    network.listen("127.0.0.1")
    heard: list[str] = []

    def broken(address: str) -> None:
        heard.append(address)
        raise ConnectionError("ssh is gone")

    network.add_listen_hook(broken)
    with pytest.raises(ConnectionError, match="ssh is gone"):
        network.thread_inbox(f"ipc://{tmp_path}/main", 1)
    assert len(heard) == 1
