"""Runs in the controller (and in a host agent): how its ranks come to be and go.  The
launcher and the record of each mesh it owns, the handle on a template (``template_client``)
and the link to a host's agent (``agent_link``), a host's capacity, rank output, stack dumps
and proc stats; and the formats both ends speak (``host_messages``, ``template_channel``,
``agent_channel``, ``launch_config``).  The template's own code is ``template/``.  It builds
on ``wire/``; it never imports ``calls/`` (what it calls there it types with protocols) or
``template/``, and ``net/`` for types only.  See docs/how-it-works.md."""
