
edge"

remote_address10.0.0.3