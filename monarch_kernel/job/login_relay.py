"""The relay a ``SlurmJob(login=...)`` runs on the login node: compute nodes cannot reach the
controller, but they reach the login node, and the controller's ssh connection to it forwards
(``-R``) each controller port to a unix socket in a 0700 folder there.  This listens on the
login node's cluster-facing address, at the same port as the controller's, and joins each
connection to that socket.  It only moves bytes: Curve and the HMAC still authenticate both
ends, as for a controller the nodes reach directly.

It is the login ssh connection's own command (``python3 -c`` this file's text; standard library
only, for whatever Python the login node has).  It says ``mk-relay dir PATH`` first, then reads
lines on its stdin: ``listen TARGET PORT`` (listen on this host's route toward TARGET, a
compute node) answers ``mk-relay listening IP PORT`` or ``mk-relay error PORT WHY``.  At EOF
(the controller or its ssh is gone) it removes its folder and exits.
"""

import os
import shutil
import socket
import sys
import tempfile
import threading


def _pump(src, dst):
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _join(conn, path):
    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        out.connect(path)
    except OSError:
        out.close()
        conn.close()
        return
    back = threading.Thread(target=_pump, args=(out, conn), daemon=True)
    back.start()
    _pump(conn, out)
    back.join()
    out.close()
    conn.close()


def _serve(listener, path):
    while True:
        try:
            conn, _addr = listener.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_join, args=(conn, path), daemon=True).start()


def _route(target):
    ip = socket.getaddrinfo(target, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # sends nothing: picks the route
        return s.getsockname()[0]


def _say(*words):
    sys.stdout.write("mk-relay " + " ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def main():
    folder = tempfile.mkdtemp(prefix="mk-relay-")  # 0700: only this user reaches the forwards in it
    _say("dir", folder)
    try:
        for line in sys.stdin:
            words = line.split()
            if len(words) != 3 or words[0] != "listen" or not words[2].isdigit():
                continue
            port = int(words[2])
            try:
                ip = _route(words[1])
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((ip, port))
                listener.listen(128)
            except OSError as e:
                _say("error", port, f"{words[1]}: {e.strerror or e}")
                continue
            threading.Thread(target=_serve, args=(listener, os.path.join(folder, str(port))), daemon=True).start()
            _say("listening", ip, port)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
