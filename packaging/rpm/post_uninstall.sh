# inplace-agent %postun ($1: 0 on removal, 1 and more on upgrade).
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || :
fi
