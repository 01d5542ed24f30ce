
edge 

remote_address203.0.113.66