"""Running as a service: systemd's notify protocol (notify.py), and the systemd unit and launchd plist that
`nodeagent service install` renders and installs (units.py)."""
