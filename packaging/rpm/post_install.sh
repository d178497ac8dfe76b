# inplace-agent %post ($1: 1 on install, 2 and more on upgrade).
# The group inplace-agent (readers of the status socket) and the directories.
if [ -x /usr/bin/systemd-sysusers ]; then
    systemd-sysusers inplace-agent.conf || :
else
    getent group inplace-agent >/dev/null || groupadd -r inplace-agent || :
fi
if [ -x /usr/bin/systemd-tmpfiles ]; then
    systemd-tmpfiles --create inplace-agent.conf || :
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || :
fi
if [ "$1" -eq 1 ]; then
    # Enabled (through the package's preset, so that an administrator's preset can say
    # otherwise), not started: it needs certificates and [authorization] first.
    systemctl --no-reload preset inplace-agent.service >/dev/null 2>&1 || :
elif [ -d /run/systemd/system ]; then
    # An upgrade restarts a running agent on the new binary; --no-block because the agent may
    # be upgrading itself (it is then waiting for this very rpm transaction).
    systemctl --no-block try-restart inplace-agent.service || :
fi
