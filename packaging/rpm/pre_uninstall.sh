# inplace-agent %preun ($1: 0 on removal, 1 and more on upgrade).
if [ "$1" -eq 0 ]; then
    systemctl --no-reload disable --now inplace-agent.service >/dev/null 2>&1 || :
fi
