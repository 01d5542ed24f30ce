
edge

path/api/v1/export

path/login/x